"""Cross-modal fusion networks: mPLUG's skip-connected network and the two designs it is compared with.

All three take image states [B, M, D] (mask [B, M] or None = all real) and text states [B, T, D]
(mask [B, T]) and return (image, text) of the same shapes.

SkipConnectedFusion (mPLUG §3.2): layer j is either
  * asymmetric co-attention (C): text = BertLayer(text, cross-attending to image); image untouched
    (Eqs. 1-3) -- the vision stream "skips" the layer;
  * connected attention (X): [v'; l'] = BertLayer([image; text]) with the concatenated mask, no
    cross-attention (Eqs. 4-5), then ``image = image + v'`` (the released code's summed skip) and
    ``text = l'``.
  Which layers are X is ``fusion_schedule``: rule "code" (released weights): j != 0 and j % S == 0;
  rule "paper" (Algorithm 1): (j + 1) % (S + 1) == 0. X layers own no cross-attention weights.
AllConnectedFusion (single stream, e.g. UNITER): concatenate once, every layer is self-attention + FFN
  over [image; text], split at the end.
TwoStreamFusion (co-attention both ways, ViLBERT/METER style): per layer a text layer (self-attn,
  cross-attn to image, FFN) and an image layer (self-attn, cross-attn to text, FFN), both reading the
  other stream's states from the previous layer.
"""
from __future__ import annotations

import torch
from torch import nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.layers.attention import concat_key_bias, key_padding_bias
from mplug_pretrain.models.layers.checkpointing import run_layer
from mplug_pretrain.models.model_config import FusionConfig
from mplug_pretrain.models.towers.text import BertLayer


def fusion_schedule(layers: int, stride: int, rule: str = "code") -> list[bool]:
    """Per fusion layer: True = connected-attention layer, False = asymmetric co-attention layer."""
    if stride < 1:
        raise ValueError(f"fusion stride must be >= 1, got {stride}")
    if rule == "code":
        return [j != 0 and j % stride == 0 for j in range(layers)]
    if rule == "paper":
        return [(j + 1) % (stride + 1) == 0 for j in range(layers)]
    raise ValueError(f"fusion schedule_rule must be 'code' or 'paper', got {rule!r}")


def schedule_pattern(schedule: list[bool]) -> str:
    """E.g. [F, F, F, T, F, F] -> 'CCCXCC' (C = co-attention, X = connected)."""
    return "".join("X" if connected else "C" for connected in schedule)


class SkipConnectedFusion(nn.Module):
    """mPLUG cross-modal skip-connected network (see module docstring)."""

    def __init__(self, width: int, heads: int, ffn_dim: int, layers: int, stride: int, rule: str, dropout: float):
        super().__init__()
        self.schedule = fusion_schedule(layers, stride, rule)
        self.layers = nn.ModuleList(BertLayer(width, heads, ffn_dim, dropout, cross_attention=not connected)
                                    for connected in self.schedule)
        self.grad_checkpointing = False

    def forward(self, image: torch.Tensor, image_mask: torch.Tensor | None, text: torch.Tensor,
                text_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        image_bias, text_bias = key_padding_bias(image_mask), key_padding_bias(text_mask)
        joint_bias = concat_key_bias([image_bias, text_bias], [image.shape[1], text.shape[1]])
        m = image.shape[1]
        for layer, connected in zip(self.layers, self.schedule):
            if connected:
                joint = run_layer(layer, torch.cat([image, text], dim=1), joint_bias,
                                  enabled=self.grad_checkpointing)  # Eqs. 4-5
                image = image + joint[:, :m]
                text = joint[:, m:]
            else:
                text = run_layer(layer, text, text_bias, image, image_bias,
                                 enabled=self.grad_checkpointing)  # Eqs. 1-3
        return image, text


class AllConnectedFusion(nn.Module):
    """Single-stream fusion: every layer is self-attention + FFN over [image; text]."""

    def __init__(self, width: int, heads: int, ffn_dim: int, layers: int, dropout: float):
        super().__init__()
        self.layers = nn.ModuleList(BertLayer(width, heads, ffn_dim, dropout, cross_attention=False)
                                    for _ in range(layers))
        self.grad_checkpointing = False

    def forward(self, image: torch.Tensor, image_mask: torch.Tensor | None, text: torch.Tensor,
                text_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        m = image.shape[1]
        bias = concat_key_bias([key_padding_bias(image_mask), key_padding_bias(text_mask)], [m, text.shape[1]])
        joint = torch.cat([image, text], dim=1)
        for layer in self.layers:
            joint = run_layer(layer, joint, bias, enabled=self.grad_checkpointing)
        return joint[:, :m], joint[:, m:]


class TwoStreamFusion(nn.Module):
    """Two-stream co-attention: both streams self-attend, cross-attend to the other stream, and run an FFN."""

    def __init__(self, width: int, heads: int, ffn_dim: int, layers: int, dropout: float):
        super().__init__()
        self.layers = nn.ModuleList(BertLayer(width, heads, ffn_dim, dropout, cross_attention=True)
                                    for _ in range(layers))
        self.image_layers = nn.ModuleList(BertLayer(width, heads, ffn_dim, dropout, cross_attention=True)
                                          for _ in range(layers))
        self.grad_checkpointing = False

    def forward(self, image: torch.Tensor, image_mask: torch.Tensor | None, text: torch.Tensor,
                text_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        image_bias, text_bias = key_padding_bias(image_mask), key_padding_bias(text_mask)
        for text_layer, image_layer in zip(self.layers, self.image_layers):
            new_text = run_layer(text_layer, text, text_bias, image, image_bias, enabled=self.grad_checkpointing)
            image = run_layer(image_layer, image, image_bias, text, text_bias, enabled=self.grad_checkpointing)
            text = new_text
        return image, text


def build_fusion(cfg: FusionConfig, width: int, heads: int, ffn_dim: int, dropout: float) -> nn.Module:
    if cfg.type == "skip":
        return SkipConnectedFusion(width, heads, ffn_dim, cfg.layers, cfg.stride, cfg.schedule_rule, dropout)
    if cfg.type == "all_connected":
        return AllConnectedFusion(width, heads, ffn_dim, cfg.layers, dropout)
    if cfg.type == "two_stream":
        return TwoStreamFusion(width, heads, ffn_dim, cfg.layers, dropout)
    raise ConfigError(f"model.fusion.type: expected skip | all_connected | two_stream, got {cfg.type!r}")
