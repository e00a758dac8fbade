"""BERT building blocks and the text encoder (the first K BERT layers).

BertLayer is post-LN, as BERT (mPLUG Eqs. 1-3):
    x = LN(x + SelfAttn(x))                 Eq. 1
    x = LN(x + CrossAttn(x, source))        Eq. 2 (only in layers built with cross-attention)
    x = LN(x + FFN(x)),  FFN = W2 GELU(W1 x)  Eq. 3
Parameter names are our own; ``bert_init.BERT_LAYER_KEYS`` maps transformers' BertLayer names onto them,
so a BertModel checkpoint loads exactly (GELU = erf form, LayerNorm eps 1e-12, as BERT).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mplug_pretrain.models.layers.attention import MultiHeadAttention, key_padding_bias
from mplug_pretrain.models.layers.checkpointing import run_layer
from mplug_pretrain.models.layers.dropout import Dropout

BERT_LN_EPS = 1e-12


class BertEmbeddings(nn.Module):
    """ids [B, T] -> LN(word + position + token_type(0)) [B, T, D]; positions start at ``position_offset``."""

    def __init__(self, vocab_size: int, width: int, max_positions: int, dropout: float):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, width)
        self.position_embeddings = nn.Embedding(max_positions, width)
        self.token_type_embeddings = nn.Embedding(2, width)
        self.norm = nn.LayerNorm(width, eps=BERT_LN_EPS)
        self.drop = Dropout(dropout)

    def forward(self, input_ids: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
        t = input_ids.shape[1]
        if position_offset + t > self.position_embeddings.num_embeddings:
            raise ValueError(f"sequence of {position_offset + t} tokens exceeds max_positions "
                             f"{self.position_embeddings.num_embeddings}")
        positions = torch.arange(position_offset, position_offset + t, device=input_ids.device)
        token_type = self.token_type_embeddings(positions.new_zeros(1))  # via forward: ZeRO-3 gathers it
        x = self.word_embeddings(input_ids) + token_type + self.position_embeddings(positions)
        return self.drop(self.norm(x))


class BertLayer(nn.Module):
    """One post-LN BERT layer, optionally with cross-attention (Eqs. 1-3 above).

    forward(x [B, T, D], bias [B,1,T|1,T] | None, source [B, S, D] | None, source_bias [B,1,1,S] | None,
            source_kv | None, source_rows [B] | None, is_causal) -> [B, T, D]
    ``source_kv``: the cross-attention keys and values [B', H, S, d] of the source, computed before (shared by
    several passes over the same source); ``source_rows`` [B] picks row ``source_rows[i]`` of them (and of
    ``source_bias``) for x row i (None: row i). ``is_causal``: causal self-attention without ``bias``.
    """

    def __init__(self, width: int, heads: int, ffn_dim: int, dropout: float, cross_attention: bool):
        super().__init__()
        self.attn = MultiHeadAttention(width, heads, dropout)
        self.attn_norm = nn.LayerNorm(width, eps=BERT_LN_EPS)
        self.cross_attn = MultiHeadAttention(width, heads, dropout) if cross_attention else None
        self.cross_norm = nn.LayerNorm(width, eps=BERT_LN_EPS) if cross_attention else None
        self.ffn_in = nn.Linear(width, ffn_dim)
        self.ffn_out = nn.Linear(ffn_dim, width)
        self.ffn_norm = nn.LayerNorm(width, eps=BERT_LN_EPS)
        self.drop = Dropout(dropout)

    def self_attention(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                       kv: tuple[torch.Tensor, torch.Tensor] | None = None, is_causal: bool = False) -> torch.Tensor:
        return self.attn_norm(x + self.drop(self.attn(x, bias=bias, kv=kv, is_causal=is_causal)))

    def cross_attention(self, x: torch.Tensor, source: torch.Tensor | None, bias: torch.Tensor | None = None,
                        kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.cross_norm(x + self.drop(self.cross_attn(x, source=source, bias=bias, kv=kv)))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_norm(x + self.drop(self.ffn_out(F.gelu(self.ffn_in(x)))))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, source: torch.Tensor | None = None,
                source_bias: torch.Tensor | None = None, source_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                source_rows: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        x = self.self_attention(x, bias, is_causal=is_causal)
        if source is None and source_kv is None:
            return self.feed_forward(x)
        if self.cross_attn is None:
            raise RuntimeError("this BertLayer was built without cross-attention")
        if source_rows is not None:  # gathered here, so activation checkpointing keeps only the shared rows
            if source_kv is not None:
                source_kv = (source_kv[0][source_rows], source_kv[1][source_rows])
            source = None if source is None else source[source_rows]
            source_bias = None if source_bias is None else source_bias[source_rows]
        x = self.cross_attention(x, source if source_kv is None else None, source_bias, kv=source_kv)
        return self.feed_forward(x)


class TextEncoder(nn.Module):
    """Unimodal BERT text encoder: embeddings + ``layers`` self-attention layers.

    forward(input_ids [B, T], attention_mask [B, T] (1 = token)) -> states [B, T, D]; states[:, 0] is l_cls.
    """

    def __init__(self, vocab_size: int, width: int, heads: int, ffn_dim: int, layers: int, max_positions: int,
                 dropout: float):
        super().__init__()
        self.embeddings = BertEmbeddings(vocab_size, width, max_positions, dropout)
        self.layers = nn.ModuleList(BertLayer(width, heads, ffn_dim, dropout, cross_attention=False)
                                    for _ in range(layers))
        self.grad_checkpointing = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids)
        bias = key_padding_bias(attention_mask)
        for layer in self.layers:
            x = run_layer(layer, x, bias, enabled=self.grad_checkpointing)
        return x


def pool_text(states: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """The text vector ITC projects: states [B, T, D], attention_mask [B, T] (1 = token) -> [B, D].

    "cls": the [CLS] state ``states[:, 0]`` (mPLUG). "mean": the mean over the caption's tokens
    (padding excluded): sum_t m_t h_t / sum_t m_t. Mean pooling helps where a BERT checkpoint's [CLS]
    barely depends on the caption (MiniLM's layer-3 [CLS]: cosine 1.000 across captions)."""
    if pooling == "cls":
        return states[:, 0]
    if pooling == "mean":
        weights = attention_mask.to(states.dtype).unsqueeze(-1)
        return (states * weights).sum(1) / weights.sum(1).clamp_min(1.0)
    raise ValueError(f"pooling: expected 'cls' or 'mean', got {pooling!r}")
