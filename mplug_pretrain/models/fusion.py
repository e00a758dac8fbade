"""Cross-modal fusion networks: mPLUG's skip-connected network and the two designs it is compared with.

All three take image states [B, M, D] (mask [B, M] or None = all real) and text states [B, T, D]
(mask [B, T]) and return (image, text) of the same shapes. ``image_rows`` [B'] (optional) fuses text row i
with image row ``image_rows[i]`` (ITM's positives and hard negatives: B' = 3B text rows over B images)
without the caller copying the image states per row.

SkipConnectedFusion (mPLUG §3.2): layer j is either
  * asymmetric co-attention (C): text = BertLayer(text, cross-attending to image); image untouched
    (Eqs. 1-3) -- the vision stream "skips" the layer;
  * connected attention (X): [v'; l'] = BertLayer([image; text]) with the concatenated mask, no
    cross-attention (Eqs. 4-5), then ``image = image + v'`` (the released code's summed skip) and
    ``text = l'``.
  Which layers are X is ``fusion_schedule``: rule "code" (released weights): j != 0 and j % S == 0;
  rule "paper" (Algorithm 1): (j + 1) % (S + 1) == 0. X layers own no cross-attention weights.
  The C layers before the first X layer see the image states unchanged, so their cross-attention keys and
  values depend on the image states alone: ``image_keys_values(image)`` computes them once, and every pass
  over the same image states (ITM, MLM, PrefixLM of one step) reuses them (``image_kv``), row-gathered by
  ``image_rows`` inside the layer. Exact: a row gather commutes with the projections.
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
from mplug_pretrain.models.layers.attention import concat_key_bias, key_padding_bias, to_autocast_dtype
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

    def image_keys_values(self, image: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """image [B, M, D] -> cross-attention (keys, values) [B, H, M, d] of each C layer before the first X
        layer, from one autocast cast of ``image``."""
        image = to_autocast_dtype(image)
        kv = []
        for layer, connected in zip(self.layers, self.schedule):
            if connected:
                break
            kv.append(layer.cross_attn.keys_values(image))
        return kv

    def forward(self, image: torch.Tensor, image_mask: torch.Tensor | None, text: torch.Tensor,
                text_mask: torch.Tensor | None, image_rows: torch.Tensor | None = None,
                image_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """image_kv: ``image_keys_values(image)`` computed before (None: computed here, when ``image_rows`` is
        given; otherwise every layer projects ``image`` itself, the computation from before the sharing)."""
        if image_kv is None and image_rows is not None:
            image_kv = self.image_keys_values(image)
        image_bias, text_bias = key_padding_bias(image_mask), key_padding_bias(text_mask)
        joint_bias = source = None
        m = image.shape[1]
        shared_kv = list(image_kv or [])
        for layer, connected in zip(self.layers, self.schedule):
            if connected:
                if image_rows is not None:  # from here on the image stream differs per text row
                    image, image_mask, image_rows = image[image_rows], _rows(image_mask, image_rows), None
                    image_bias = key_padding_bias(image_mask)
                shared_kv = []
                if joint_bias is None:
                    joint_bias = concat_key_bias([image_bias, text_bias], [m, text.shape[1]])
                joint = run_layer(layer, torch.cat([image, text], dim=1), joint_bias,
                                  enabled=self.grad_checkpointing)  # Eqs. 4-5
                image, source = image + joint[:, :m], None
                text = joint[:, m:]
            else:  # Eqs. 1-3; keys/values shared while the image states are the ones given
                kv = shared_kv.pop(0) if shared_kv else None
                if kv is None and source is None:
                    source = to_autocast_dtype(image)  # one cast for the C layers up to the next X layer
                text = run_layer(layer, text, text_bias, None if kv else source, image_bias, kv, image_rows,
                                 enabled=self.grad_checkpointing)
        if image_rows is not None:
            image = image[image_rows]
        return image, text


def _rows(mask: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if mask is None else mask[rows]


class AllConnectedFusion(nn.Module):
    """Single-stream fusion: every layer is self-attention + FFN over [image; text]."""

    def __init__(self, width: int, heads: int, ffn_dim: int, layers: int, dropout: float):
        super().__init__()
        self.layers = nn.ModuleList(BertLayer(width, heads, ffn_dim, dropout, cross_attention=False)
                                    for _ in range(layers))
        self.grad_checkpointing = False

    def image_keys_values(self, image: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []  # no layer cross-attends to the image states as given

    def forward(self, image: torch.Tensor, image_mask: torch.Tensor | None, text: torch.Tensor,
                text_mask: torch.Tensor | None, image_rows: torch.Tensor | None = None,
                image_kv: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if image_rows is not None:
            image, image_mask = image[image_rows], _rows(image_mask, image_rows)
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

    def image_keys_values(self, image: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []  # every layer's image states depend on the text (both streams update)

    def forward(self, image: torch.Tensor, image_mask: torch.Tensor | None, text: torch.Tensor,
                text_mask: torch.Tensor | None, image_rows: torch.Tensor | None = None,
                image_kv: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if image_rows is not None:
            image, image_mask = image[image_rows], _rows(image_mask, image_rows)
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
