"""ExpansionNet v2 text decoder over the fused mPLUG memory (decoder_api contract), plus the small
pieces every non-BERT decoder head shares (text embedding, cross-attention, input checks, beam
reordering of caches).

Decoder layer n (pre-LN, paper Eq. 12):
    B_n = Y_{n-1} + DynamicExp_n(LN(Y_{n-1}))          causal dynamic expansion, N_E = cfg.expansion_slots
    W_n = B_n + CrossAttention_n(LN(B_n), memory)      multi-head, F.scaled_dot_product_attention
    Y_n = W_n + FF_n(LN(W_n))
Head: Y~ = LN(Y_N + Dropout(W_dec [Y_1; ...; Y_N])), logits = W_voc Y~ (W_voc tied to the token
embedding when cfg.tie_word_embeddings). Input: token embedding * sqrt(d) + learned position.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.api import DecoderOutput
from mplug_pretrain.models.decoders.expansionnet.layers import (
    DynamicExpansion,
    DynamicExpansionState,
    LayerCombination,
)
from mplug_pretrain.models.heads.lm_head import vocab_logits
from mplug_pretrain.models.model_config import DecoderConfig


def check_decoder_config(cfg: DecoderConfig, width: int) -> None:
    """Raise ConfigError naming the decoder field that cannot build a decoder of this width."""
    if cfg.heads < 1 or width % cfg.heads:
        raise ConfigError(f"decoder.heads: text width {width} not divisible by {cfg.heads}")
    for name in ("layers", "ffn_dim", "max_positions"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"decoder.{name}: expected >= 1, got {getattr(cfg, name)}")


def check_decoder_inputs(input_ids: Tensor, attention_mask: Tensor, memory: Tensor | None,
                         memory_mask: Tensor | None, past_len: int, width: int) -> None:
    """Shape checks of the decoder_api call; raises ValueError naming the argument."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [B, T_new], got shape {tuple(input_ids.shape)}")
    b, t_new = input_ids.shape
    if attention_mask.shape != (b, past_len + t_new):
        raise ValueError(f"attention_mask: expected shape {(b, past_len + t_new)} (T_past={past_len} + "
                         f"T_new={t_new}), got {tuple(attention_mask.shape)}")
    if memory is not None and (memory.dim() != 3 or memory.shape[0] != b or memory.shape[2] != width):
        raise ValueError(f"memory: expected [{b}, M, {width}], got {tuple(memory.shape)}")
    if memory is not None and memory_mask is not None and memory_mask.shape != memory.shape[:2]:
        raise ValueError(f"memory_mask: expected shape {tuple(memory.shape[:2])}, got {tuple(memory_mask.shape)}")


def select_batch_rows(tree: Any, index: Tensor) -> Any:
    """index_select(0, index) on every tensor of a (named) tuple tree: beam-search cache reordering."""
    if isinstance(tree, Tensor):
        return tree.index_select(0, index.to(tree.device))
    if isinstance(tree, tuple):
        items = [select_batch_rows(item, index) for item in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    if tree is None:
        return None
    raise TypeError(f"select_batch_rows: unsupported cache entry {type(tree).__name__}")


def init_and_tie(decoder: nn.Module, tie: bool) -> None:
    """ExpansionNet's official init (Xavier-uniform for every matrix), then ``decoder.lm_head`` tied to
    ``decoder.embedding.token`` when ``tie``."""
    for p in decoder.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    if tie:
        decoder.lm_head.weight = decoder.embedding.token.weight


def project_to_vocab(lm_head: nn.Module, y: Tensor, vocab: slice | None) -> Tensor:
    """y [..., D] -> logits [..., V] through ``lm_head`` (a packed copy inside packed_for_decoding), or just the
    rows of ``vocab`` [..., len(vocab)]."""
    return lm_head(y) if vocab is None else vocab_logits(y, lm_head.weight, lm_head.bias, vocab)


def memory_keys_values(layers: nn.ModuleList, memory: Tensor, memory_mask: Tensor,
                       past: Any | None) -> tuple[tuple[tuple[Tensor, Tensor], ...], Tensor]:
    """(per-layer cross-attention (k, v) of the memory, bool memory mask [B, 1, 1, M]): projected on the first
    call, then read from the cache ``past`` (its ``memory_kv`` and ``memory_mask``)."""
    if past is not None:
        return past.memory_kv, past.memory_mask
    return tuple(layer.cross.project_memory(memory) for layer in layers), memory_mask.bool()[:, None, None, :]


class TextEmbedding(nn.Module):
    """Token embedding * sqrt(d) + learned absolute position embedding, dropout (ExpansionNet code).

    input_ids [B, T_new], past_len -> [B, T_new, d]; positions past_len .. past_len + T_new - 1.
    """

    def __init__(self, vocab_size: int, width: int, max_positions: int, dropout: float):
        super().__init__()
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(max_positions, width)
        self.dropout = nn.Dropout(dropout)
        self.scale = math.sqrt(width)

    def forward(self, input_ids: Tensor, past_len: int) -> Tensor:
        t_end = past_len + input_ids.shape[1]
        if t_end > self.position.num_embeddings:
            raise ValueError(f"decoder input: position {t_end - 1} exceeds decoder.max_positions "
                             f"{self.position.num_embeddings}")
        positions = torch.arange(past_len, t_end, device=input_ids.device)
        return self.dropout(self.token(input_ids) * self.scale + self.position(positions))


class CrossAttention(nn.Module):
    """Multi-head attention from text to memory with F.scaled_dot_product_attention.

    project_memory(memory [B, M, d]) -> (k, v) [B, h, M, d/h], computed once and cached by decoders;
    forward(x [B, T, d], k, v, memory_mask bool [B, 1, 1, M]) -> [B, T, d].
    """

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def _split(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        return self._split(self.key(memory)), self._split(self.value(memory))

    def forward(self, x: Tensor, k: Tensor, v: Tensor, memory_mask: Tensor) -> Tensor:
        b, t, d = x.shape
        o = F.scaled_dot_product_attention(self._split(self.query(x)), k, v, attn_mask=memory_mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(o.transpose(1, 2).reshape(b, t, d))


def feed_forward(width: int, ffn_dim: int, dropout: float) -> nn.Sequential:
    """FF: Linear(d, d_ff) -> ReLU -> Dropout -> Linear(d_ff, d) (ExpansionNet / Transformer)."""
    return nn.Sequential(nn.Linear(width, ffn_dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn_dim, width))


class ExpansionDecoderLayer(nn.Module):
    """One pre-LN decoder layer (Eq. 12). y [B, T_new, d] -> (y, dynamic-expansion state)."""

    def __init__(self, width: int, heads: int, ffn_dim: int, slots: int, dropout: float):
        super().__init__()
        self.norm_expansion = nn.LayerNorm(width)
        self.expansion = DynamicExpansion(width, slots, dropout, causal=True)
        self.norm_cross = nn.LayerNorm(width)
        self.cross = CrossAttention(width, heads, dropout)
        self.norm_ffn = nn.LayerNorm(width)
        self.ffn = feed_forward(width, ffn_dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, y: Tensor, key_valid: Tensor, memory_kv: tuple[Tensor, Tensor], memory_mask: Tensor,
                state: DynamicExpansionState | None) -> tuple[Tensor, DynamicExpansionState]:
        h, state = self.expansion(self.norm_expansion(y), key_valid, state)
        y = y + self.dropout(h)
        y = y + self.dropout(self.cross(self.norm_cross(y), *memory_kv, memory_mask))
        return y + self.dropout(self.ffn(self.norm_ffn(y))), state


class ExpansionDecoderCache(NamedTuple):
    """Per-layer dynamic-expansion states, per-layer projected memory (k, v), memory mask [B,1,1,M]."""
    expansion: tuple[DynamicExpansionState, ...]
    memory_kv: tuple[tuple[Tensor, Tensor], ...]
    memory_mask: Tensor

    @property
    def length(self) -> int:
        return self.expansion[0].keys.shape[1]


class ExpansionDecoder(nn.Module):
    """ExpansionNet v2 decoder head; ``forward`` and ``reorder_cache`` as ``decoder_api`` states them (the
    cache: ``ExpansionDecoderCache``)."""

    def __init__(self, cfg: DecoderConfig, vocab_size: int, width: int):
        super().__init__()
        check_decoder_config(cfg, width)
        if cfg.expansion_slots < 1:
            raise ConfigError(f"decoder.expansion_slots: expected >= 1, got {cfg.expansion_slots}")
        self.width = width
        self.embedding = TextEmbedding(vocab_size, width, cfg.max_positions, cfg.dropout)
        self.layers = nn.ModuleList(
            ExpansionDecoderLayer(width, cfg.heads, cfg.ffn_dim, cfg.expansion_slots, cfg.dropout)
            for _ in range(cfg.layers))
        self.combination = LayerCombination(width, cfg.layers, cfg.dropout)
        self.lm_head = nn.Linear(width, vocab_size)
        init_and_tie(self, cfg.tie_word_embeddings)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, memory: Tensor, memory_mask: Tensor,
                past: ExpansionDecoderCache | None = None, use_cache: bool = False,
                vocab: slice | None = None) -> DecoderOutput:
        past_len = 0 if past is None else past.length
        check_decoder_inputs(input_ids, attention_mask, None if past is not None else memory, memory_mask,
                             past_len, self.width)
        key_valid = attention_mask.bool()
        memory_kv, mem_mask = memory_keys_values(self.layers, memory, memory_mask, past)
        y = self.embedding(input_ids, past_len)
        outputs, states = [], []
        for i, layer in enumerate(self.layers):
            y, state = layer(y, key_valid, memory_kv[i], mem_mask, None if past is None else past.expansion[i])
            outputs.append(y)
            states.append(state)
        logits = project_to_vocab(self.lm_head, self.combination(outputs), vocab)
        new_past = ExpansionDecoderCache(tuple(states), memory_kv, mem_mask) if use_cache else None
        return DecoderOutput(logits=logits, past=new_past)

    @staticmethod
    def reorder_cache(past: ExpansionDecoderCache, index: Tensor) -> ExpansionDecoderCache:
        return select_batch_rows(past, index)
