"""A timm or open_clip vision tower behind our ViT's interface: ``image [B, 3, S, S] -> tokens [B, 1 + M, D]``,
token 0 the pooled one that ITC reads, then the M patch tokens that fusion and the decoder attend to.

    model.vision.backbone: timm:vit_base_patch16_siglip_256       # SigLIP (no [CLS]: its MAP head pools)
    model.vision.backbone: timm:eva02_base_patch14_224            # EVA-02 ([CLS])
    model.vision.backbone: open_clip:ViT-B-16                     # open_clip's own ViT ([CLS])
    model.vision.backbone_kwargs: {depth: 2, embed_dim: 64}       # passed to the factory (sizes for tests)

Token 0: the tower's own pooled representation (timm: ``forward_head(pre_logits=True)``: its [CLS] through
``fc_norm`` for ViT / EVA, SigLIP's attention pool, the mean for towers that average; open_clip: ``ln_post`` of
[CLS]); a tower without pooling gives its [CLS], else the mean of the patch tokens.
Register tokens are dropped. ``width`` is the tower's output width: a projection to the text width follows when
they differ (models/towers/vision.py), as the official code does for ViT-L.

Weights: ``vision.checkpoint_path`` (models/weights/weights_file.py: safetensors, TorchScript read as data, or a
torch file read with ``weights_only=True``) with the
tower's own keys (open_clip: a full CLIP checkpoint's ``visual.*`` keys are taken), or
``vision.backbone_pretrained: true`` for timm's pretrained weights (through its Hugging Face Hub cache, which works
offline once downloaded). Our own ViT stays the default because the OpenAI CLIP and official mPLUG checkpoints load into it, not for
speed: at equal size it is 1.06x faster in a no-grad forward and timm's is 1.21x faster in a training step
(bench/README.md, `mplug bench vision-tower`).
"""
from __future__ import annotations

import torch
from torch import nn

from mplug_pretrain.errors import ConfigError

BACKBONE_KINDS = ("clip_vit", "timm", "open_clip")


def parse_backbone(spec: str) -> tuple[str, str]:
    """``clip_vit`` -> ("clip_vit", ""); ``timm:NAME`` / ``open_clip:NAME`` -> (kind, NAME)."""
    if spec == "clip_vit":
        return "clip_vit", ""
    kind, _, name = spec.partition(":")
    if kind not in ("timm", "open_clip") or not name:
        raise ConfigError(f"model.vision.backbone: expected clip_vit, timm:<model name> or open_clip:<model name>, "
                          f"got {spec!r}")
    return kind, name


def _import(package: str):
    import mplug_pretrain.compat  # noqa: F401  (the torchvision shim timm and open_clip need)
    try:
        return __import__(package)
    except ImportError as err:
        raise ConfigError(f"model.vision.backbone: {package} is not installed (pip install "
                          f"{'timm' if package == 'timm' else 'open_clip_torch'})") from err


def _timm_trunk(name: str, image_size: int, kwargs: dict, pretrained: bool) -> nn.Module:
    timm = _import("timm")
    try:
        return timm.create_model(name, pretrained=pretrained, num_classes=0, img_size=image_size, **kwargs)
    except RuntimeError as err:
        if "Unknown model" in str(err):
            raise ConfigError(f"model.vision.backbone: timm has no model {name!r} (timm.list_models('*vit*'))") from err
        raise


def _open_clip_visual(name: str, image_size: int, kwargs: dict) -> nn.Module:
    open_clip = _import("open_clip")
    from open_clip.model import _build_vision_tower
    config = open_clip.get_model_config(name)
    if config is None:
        raise ConfigError(f"model.vision.backbone: open_clip has no model {name!r} (open_clip.list_models())")
    vision_cfg = {**config["vision_cfg"], "image_size": image_size, **kwargs}
    return _build_vision_tower(config["embed_dim"], vision_cfg, quick_gelu=config.get("quick_gelu", False))


class ExternalTower(nn.Module):
    """See the module docstring. ``trunk``: the timm model, or open_clip's visual tower."""

    def __init__(self, backbone: str, image_size: int, kwargs: dict | None = None, pretrained: bool = False):
        super().__init__()
        kind, name = parse_backbone(backbone)
        kwargs = dict(kwargs or {})
        if kind == "timm":
            self.trunk = _timm_trunk(name, image_size, kwargs, pretrained)
        else:
            if pretrained:
                raise ConfigError("model.vision.backbone_pretrained: for open_clip towers give the weights file as "
                                  "model.vision.checkpoint_path (an open_clip checkpoint; its visual.* keys are used)")
            visual = _open_clip_visual(name, image_size, kwargs)
            self.trunk = getattr(visual, "trunk", visual)  # open_clip's TimmModel (SigLIP, EVA) wraps a timm trunk
            if getattr(self.trunk, "proj", None) is not None:
                self.trunk.proj = None  # CLIP's embedding projection: ITC has its own (models/heads)
        self.is_timm = hasattr(self.trunk, "forward_features")
        if self.is_timm:
            self.width = int(self.trunk.num_features)
            grid = self.trunk.patch_embed.grid_size
        else:
            self.width = int(self.trunk.transformer.width)
            grid = self.trunk.grid_size
        self.grid = int(grid[0]) if isinstance(grid, (tuple, list)) else int(grid)

    @property
    def has_class_token(self) -> bool:
        return getattr(self.trunk, "cls_token", None) is not None or hasattr(self.trunk, "class_embedding")

    def no_weight_decay(self) -> set[str]:
        own = self.trunk.no_weight_decay() if hasattr(self.trunk, "no_weight_decay") else set()
        names = {name for name, _ in self.named_parameters()}
        return {f"trunk.{n}" for n in own if f"trunk.{n}" in names}

    def set_grad_checkpointing(self, enable: bool | str = True) -> None:
        if hasattr(self.trunk, "set_grad_checkpointing"):
            self.trunk.set_grad_checkpointing(bool(enable))  # "selective": timm checkpoints whole blocks

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if self.is_timm:
            features = self.trunk.forward_features(image)  # [B, prefix + M, D], final norm applied
            prefix = int(getattr(self.trunk, "num_prefix_tokens", 0))
            patches = features[:, prefix:]
            pooled = self.trunk.forward_head(features, pre_logits=True)  # the tower's own pooling
            if pooled.ndim != 2:  # global_pool='': its [CLS], else the mean of the patches
                pooled = features[:, 0] if prefix else patches.mean(dim=1)
        else:  # open_clip's VisionTransformer: its last block's tokens through ln_post
            out = self.trunk.forward_intermediates(image, indices=1, normalize_intermediates=True,
                                                   intermediates_only=True, output_fmt="NLC",
                                                   output_extra_tokens=True)
            patches = out["image_intermediates"][-1]
            prefix = out.get("image_intermediates_prefix")
            pooled = prefix[-1][:, 0] if prefix is not None and prefix[-1].shape[1] else patches.mean(dim=1)
        return torch.cat([pooled.unsqueeze(1), patches], dim=1)


def load_tower_weights(tower: ExternalTower, path: str) -> None:
    """A safetensors / torch (weights_only) file with the trunk's keys, or a full open_clip checkpoint."""
    from mplug_pretrain.models.weights.weights_file import read_weights_file, tensors_only
    state = tensors_only(read_weights_file(path, "model.vision.checkpoint_path"), path)
    for prefix in ("visual.", "trunk."):  # a full open_clip checkpoint; its TimmModel's trunk is our trunk
        if any(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    missing, unexpected = tower.trunk.load_state_dict(state, strict=False)
    if missing:
        raise ConfigError(f"model.vision.checkpoint_path: {path} lacks {len(missing)} tower weights "
                          f"(first: {missing[0]}); unexpected keys: {unexpected[:3]}")
