"""Load CLIP ViT weights from a local OpenAI CLIP, open_clip or timm file into ``VisionTransformer``.

Files (models/weights/weights_file.py; nothing in them runs): ``.safetensors``; TorchScript archives (OpenAI's
released ``ViT-B-16.pt``) read as data; torch files read with ``torch.load(weights_only=True)``; the state dict
plain or wrapped in ``state_dict`` / ``model``, optionally ``module.``-prefixed.

Formats (``auto`` detects them from the key names):
  openai / open_clip: ``visual.conv1.weight``, ``visual.transformer.resblocks.{i}.attn.in_proj_weight`` ...
      (our names minus ``visual.``); the text tower and ``visual.proj`` are dropped.
  timm (``vit_*_clip_*``): ``patch_embed.proj.weight``, ``cls_token``, ``pos_embed``, ``norm_pre``,
      ``blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}``, ``norm``; ``head`` dropped.
A checkpoint grid different from the configured one gets its positional embedding resized bilinearly.
"""
from __future__ import annotations

from typing import Literal

import torch

from mplug_pretrain.models.towers.vision import VisionTransformer, resize_positional_embedding
from mplug_pretrain.models.weights.weights_file import read_weights_file, tensors_only

TIMM_BLOCK_KEYS = {
    "norm1": "ln_1", "attn.qkv.weight": "attn.in_proj_weight", "attn.qkv.bias": "attn.in_proj_bias",
    "attn.proj": "attn.out_proj", "norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
}
TIMM_TOP_KEYS = {"patch_embed.proj.weight": "conv1.weight", "norm_pre": "ln_pre", "norm": "ln_post"}
DROPPED_TIMM_PREFIXES = ("head.", "fc_norm.")


def read_state_dict(path: str, field: str = "model.vision.checkpoint_path") -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file (weights_file.py: nothing in it runs), unwrapped from ``state_dict`` / ``model``
    and ``module.`` prefixes."""
    return tensors_only(read_weights_file(path, field), path)


def detect_format(sd: dict[str, torch.Tensor]) -> Literal["openai", "timm"]:
    if "visual.conv1.weight" in sd or "conv1.weight" in sd:
        return "openai"  # open_clip uses the same visual-tower names
    if "patch_embed.proj.weight" in sd:
        return "timm"
    raise ValueError("unrecognized vision checkpoint: no visual.conv1.weight (OpenAI/open_clip) "
                     "or patch_embed.proj.weight (timm) key")


def _from_openai(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if "visual.conv1.weight" in sd:
        sd = {k[len("visual."):]: v for k, v in sd.items() if k.startswith("visual.")}
    return {k: v for k, v in sd.items() if k != "proj"}  # the CLIP projection: mPLUG keeps all tokens before it


def _from_timm(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.startswith(DROPPED_TIMM_PREFIXES):
            continue
        if key == "cls_token":
            out["class_embedding"] = value.reshape(-1)
        elif key == "pos_embed":
            out["positional_embedding"] = value.reshape(-1, value.shape[-1])
        elif key.startswith("blocks."):
            _, index, rest = key.split(".", 2)
            name = next((ours + rest[len(theirs):] for theirs, ours in TIMM_BLOCK_KEYS.items()
                         if rest == theirs or rest.startswith(theirs + ".")), rest)
            out[f"transformer.resblocks.{index}.{name}"] = value
        else:
            top = next((ours + key[len(theirs):] for theirs, ours in TIMM_TOP_KEYS.items()
                        if key == theirs or key.startswith(theirs + ".")), key)
            out[top] = value
    return out


def convert_vision_state_dict(sd: dict[str, torch.Tensor], grid: int,
                              fmt: Literal["auto", "openai", "open_clip", "timm"] = "auto") -> dict[str, torch.Tensor]:
    """Foreign ViT keys -> ``VisionTransformer`` keys, positional embedding resized to ``grid``."""
    fmt = detect_format(sd) if fmt == "auto" else fmt
    out = _from_timm(sd) if fmt == "timm" else _from_openai(sd)
    if "positional_embedding" in out:
        out["positional_embedding"] = resize_positional_embedding(out["positional_embedding"], grid)
    return out


def load_vision_checkpoint(vit: VisionTransformer, path: str,
                           fmt: Literal["auto", "openai", "open_clip", "timm"] = "auto") -> None:
    """Copy a local CLIP ViT checkpoint into ``vit``; any missing, unexpected or mis-shaped key is an error."""
    sd = convert_vision_state_dict(read_state_dict(path), vit.grid, fmt)
    own = vit.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        raise ValueError(f"{path}: does not match model.vision ({len(own)} tensors): missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]} (check vision.layers / checkpoint_format)")
    for key, value in sd.items():
        if value.shape != own[key].shape:
            raise ValueError(f"{path}: {key} has shape {tuple(value.shape)}, model.vision expects "
                             f"{tuple(own[key].shape)} (check vision.width / patch_size / mlp_ratio)")
    vit.load_state_dict(sd)
