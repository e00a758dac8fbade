"""Builds the configured text decoder head and the optional visual-token refiner.

build_decoder(cfg, vocab_size, width) -> a module implementing ``decoder_api`` (bert | expansion | acf).
build_visual_refiner(cfg, width, grid_size) -> module mapping tokens [B, 1+M, D] -> [B, 1+M, D], or None.
The expansion / ACF classes live in their own files and are imported only when chosen.
"""
from __future__ import annotations

from torch import nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.model_config import DecoderConfig, VisualRefinerConfig


def build_decoder(cfg: DecoderConfig, vocab_size: int, width: int) -> nn.Module:
    if cfg.type == "bert":
        from mplug_pretrain.models.decoders.bert import BertDecoder
        return BertDecoder(cfg, vocab_size=vocab_size, width=width)
    if cfg.type == "expansion":
        from mplug_pretrain.models.decoders.expansionnet.decoder import ExpansionDecoder
        return ExpansionDecoder(cfg, vocab_size=vocab_size, width=width)
    if cfg.type == "acf":
        from mplug_pretrain.models.decoders.acf.decoder import ACFDecoder
        return ACFDecoder(cfg, vocab_size=vocab_size, width=width)
    raise ConfigError(f"model.decoder.type: expected bert | expansion | acf, got {cfg.type!r}")


def build_visual_refiner(cfg: VisualRefinerConfig, width: int, grid_size: int) -> nn.Module | None:
    if cfg.type == "none":
        return None
    if cfg.type == "static_expansion":
        from mplug_pretrain.models.decoders.expansionnet.encoder import StaticExpansionRefiner
        return StaticExpansionRefiner(cfg, width=width, grid_size=grid_size)
    if cfg.type == "acf":
        from mplug_pretrain.models.decoders.acf.encoder import ACFVisualRefiner
        return ACFVisualRefiner(cfg, width=width, grid_size=grid_size)
    raise ConfigError(f"model.refiner.type: expected none | static_expansion | acf, got {cfg.type!r}")
