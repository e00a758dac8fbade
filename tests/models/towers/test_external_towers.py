"""Vision towers from timm and open_clip by name (issue 26): small random-initialised ViT (timm and open_clip),
SigLIP (no [CLS]: its MAP head pools for ITC) and EVA-02 towers through a pretraining step (all four losses,
gradients into the tower, an optimizer step) and a captioning step, a projection when the tower's width differs
from the text width, and a save / load round trip."""
from __future__ import annotations

import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim before timm / open_clip)
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.presets import build_model

timm = pytest.importorskip("timm")
open_clip = pytest.importorskip("open_clip")

TOWERS = {  # name: (backbone, factory kwargs, image size, has [CLS], tower width)
    "timm-vit": ("timm:vit_tiny_patch16_224", {"depth": 2}, 32, True, 192),
    "timm-siglip": ("timm:vit_base_patch16_siglip_224",
                    {"embed_dim": 64, "depth": 2, "num_heads": 2, "patch_size": 8}, 32, False, 64),
    "timm-eva02": ("timm:eva02_tiny_patch14_224", {"depth": 2}, 28, True, 192),
    "open_clip-vit": ("open_clip:ViT-B-16", {"width": 128, "layers": 2, "patch_size": 8, "head_width": 32}, 32, True,
                      128),
}


def _model(name: str) -> MPLUG:
    backbone, kwargs, size, _, _ = TOWERS[name]
    torch.manual_seed(0)
    return build_model("tiny", vision={"backbone": backbone, "backbone_kwargs": kwargs, "image_size": size})


def _batch(size: int, b: int = 4, t: int = 10) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (b, t), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    return {"image": torch.randn(b, 3, size, size, generator=g), "input_ids": ids,
            "attention_mask": torch.ones(b, t, dtype=torch.long), "image_id": torch.arange(b)}


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_a_tower_trains_a_pretraining_and_a_captioning_step(name):
    _, _, size, has_cls, width = TOWERS[name]
    model = _model(name).train()
    tower = model.image_encoder.vit
    assert tower.width == width and tower.has_class_token is has_cls
    assert (model.image_encoder.projection is not None) is (width != model.config.text.width)
    batch = _batch(size)
    with torch.no_grad():  # token 0 is what ITC reads: the tower's own pooled representation
        tokens = tower(batch["image"])
        trunk = tower.trunk
        if hasattr(trunk, "forward_features"):
            pooled = trunk(batch["image"])  # timm's own forward: pooled pre-logits (num_classes=0)
        else:
            pooled = trunk(batch["image"])  # open_clip's own forward: ln_post([CLS]) (its CLIP projection removed)
        assert tokens.shape == (4, 1 + tower.grid ** 2, width)
        assert torch.allclose(tokens[:, 0], pooled, atol=1e-4)
    optimizer = torch.optim.AdamW(model.param_groups(0.01, 1e-4, 1e-4))
    before = {n: p.detach().clone() for n, p in tower.named_parameters()}
    out = model(batch)
    assert {"loss_itc", "loss_itm", "loss_mlm", "loss_prefixlm"} <= set(out) and torch.isfinite(out["loss"])
    out["loss"].backward()
    no_grad = [n for n, p in tower.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, no_grad
    optimizer.step()
    assert all(not torch.equal(before[n], p) for n, p in tower.named_parameters())
    assert model.image_encoder_m is not None and model.image_encoder_m.vit.width == width  # momentum copy

    optimizer.zero_grad()
    prompt_length = 4
    loss = model.caption_loss(batch["image"], batch["input_ids"], batch["attention_mask"], prompt_length)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in tower.parameters())


def test_a_tower_model_saves_and_loads_equal(tmp_path):
    model = _model("timm-siglip").eval()
    model.save_pretrained(str(tmp_path))
    loaded = MPLUG.from_pretrained(str(tmp_path)).eval()
    assert loaded.config.vision.backbone == TOWERS["timm-siglip"][0]
    batch = _batch(32)
    with torch.no_grad():
        assert torch.equal(model.image_encoder(batch["image"]), loaded.image_encoder(batch["image"]))
    with pytest.raises(ConfigError, match="re-targeting the input size is for our ViT only"):
        MPLUG.from_pretrained(str(tmp_path), image_size=64)


def test_our_vit_folders_keep_their_config_json(tmp_path):
    """clip_vit (the default) writes no backbone keys: folders stay readable by readers that predate them."""
    import json
    build_model("tiny").save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert "backbone" not in json.load(f)["vision"]


@pytest.mark.parametrize("backbone, message", [
    ("timm:no_such_model", "timm has no model 'no_such_model'"),
    ("open_clip:No-Such", "open_clip has no model 'No-Such'"),
    ("torchvision:resnet50", "expected clip_vit, timm:<model name> or open_clip:<model name>"),
])
def test_unknown_towers_are_named(backbone, message):
    with pytest.raises(ConfigError, match=message):
        build_model("tiny", vision={"backbone": backbone})
