"""Model presets and the model builder.

tiny  : CPU tests / demo. ViT 64px, patch 8, width 128, 2 layers; BERT width 128, 2 heads, 2 text + 2 fusion
        layers (stride 1: C X), 2 decoder layers, BERT vocab 30522, queue 1024.
base  : mPLUG_ViT-B. CLIP ViT-B/16 at 256 (257 tokens) + BERT-base (6 text + 6 fusion layers, stride 3:
        C C C X C C), 12-layer decoder, queue 65,536.
large : mPLUG_ViT-L. CLIP ViT-L/14 at 224 (257 tokens), Linear+LN 1024 -> 768, stride 6 (C C C C C C).

build_model(preset, **overrides): overrides are dotted ("fusion.stride": 2, or fusion__stride=2) or a
section dict (fusion={"stride": 2}).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.model_config import (
    DecoderConfig,
    FusionConfig,
    HeadsConfig,
    ModelConfig,
    TextConfig,
    VisionConfig,
)


def _tiny() -> ModelConfig:
    return ModelConfig(
        preset="tiny",
        vision=VisionConfig(image_size=64, patch_size=8, width=128, layers=2, heads=2),
        text=TextConfig(width=128, heads=2, ffn_dim=512, encoder_layers=2),
        fusion=FusionConfig(layers=2, stride=1),
        decoder=DecoderConfig(layers=2, heads=2, ffn_dim=512),
        heads=HeadsConfig(queue_size=1024),
    )


def _base() -> ModelConfig:
    return ModelConfig(
        preset="base",
        vision=VisionConfig(image_size=256, patch_size=16, width=768, layers=12, heads=12),
        text=TextConfig(width=768, heads=12, ffn_dim=3072, encoder_layers=6),
        fusion=FusionConfig(layers=6, stride=3),
        decoder=DecoderConfig(layers=12, heads=12, ffn_dim=3072),
    )


def _large() -> ModelConfig:
    return ModelConfig(
        preset="large",
        vision=VisionConfig(image_size=224, patch_size=14, width=1024, layers=24, heads=16),
        text=TextConfig(width=768, heads=12, ffn_dim=3072, encoder_layers=6),
        fusion=FusionConfig(layers=6, stride=6),
        decoder=DecoderConfig(layers=12, heads=12, ffn_dim=3072),
    )


PRESETS = {"tiny": _tiny, "base": _base, "large": _large}


def get_preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return PRESETS[name]()


def apply_overrides(config: ModelConfig, overrides: dict[str, Any]) -> ModelConfig:
    """Return a copy of ``config`` with dotted / ``__`` / per-section overrides applied."""
    config = dataclasses.replace(config)
    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if isinstance(value, dict) and "." not in key and dataclasses.is_dataclass(getattr(config, key, None)):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    for dotted, value in flat.items():
        target, parts = config, dotted.split(".")
        for i, part in enumerate(parts):
            if not hasattr(target, part):
                raise ConfigError(f"model.{'.'.join(parts[:i + 1])}: unknown field")
            if i == len(parts) - 1:
                setattr(target, part, value)
            else:
                child = dataclasses.replace(getattr(target, part))  # copy: presets share no state
                setattr(target, part, child)
                target = child
    return config


def build_model(preset: str = "tiny", **overrides: Any) -> nn.Module:
    from mplug_pretrain.models.mplug import MPLUG
    return MPLUG(apply_overrides(get_preset_config(preset), overrides))


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """total: all parameters; trainable: requires_grad; momentum: the no-grad momentum copies;
    plus per top-level component (image_encoder, text_encoder, fusion, decoder, heads)."""
    counts = {"total": 0, "trainable": 0, "momentum": 0}
    for name, p in model.named_parameters():
        counts["total"] += p.numel()
        if p.requires_grad:
            counts["trainable"] += p.numel()
        if any(part.endswith("_m") for part in name.split(".")):
            counts["momentum"] += p.numel()
            continue
        part = name.split(".")[0]
        part = part if part in ("image_encoder", "text_encoder", "fusion", "decoder") else "heads"
        counts[part] = counts.get(part, 0) + p.numel()
    return counts
