"""ACF text decoder over the fused mPLUG memory (decoder_api contract).

Layer m (post-LN as in the paper's Fig. 3), y [B, T_new, d]:
    C(m)  = causal rows of the 1-D clustering matrix of y (Eq. 2-4); entry (j, i), i <= j, depends
            only on y_i..y_j, so it is compatible with the causal mask
    C~(m) = (1 - C(m)) C~(m-1) + C(m)                                   (Eq. 5, rows of the new positions)
    y     = LN(y + ClusteredSelfAttention(y, C~(m), causal & non-pad keys))
    y     = LN(y + CrossAttention(y, memory))
    y     = LN(y + FF(y))
logits = W_voc y (tied to the token embedding when cfg.tie_word_embeddings). The incremental cache
holds per layer the self-attention keys/values, the prefix sums of the span means and the last
column of log C; past rows of C and C~ never change, so a step costs O(T_past) per layer, like the
key/value cache of ordinary attention.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from mplug_pretrain.models.acf import ClusteredSelfAttention, ClusterEstimator1D, ClusterState, stack_clusters
from mplug_pretrain.models.decoder_api import DecoderOutput
from mplug_pretrain.models.expansion_decoder import (
    CrossAttention,
    TextEmbedding,
    check_decoder_config,
    check_decoder_inputs,
    feed_forward,
    select_batch_rows,
)
from mplug_pretrain.models.model_config import DecoderConfig


class ACFLayerState(NamedTuple):
    keys: Tensor  # [B, h, T, d/h]
    values: Tensor  # [B, h, T, d/h]
    clusters: ClusterState


class ACFDecoderLayer(nn.Module):
    """y [B, T_new, d], prior rows C~(m-1) [B, T_new, T] or None -> (y, C~(m) rows, state)."""

    def __init__(self, width: int, heads: int, ffn_dim: int, dropout: float):
        super().__init__()
        self.clusters = ClusterEstimator1D(width)
        self.attention = ClusteredSelfAttention(width, heads, dropout)
        self.norm_attention = nn.LayerNorm(width)
        self.cross = CrossAttention(width, heads, dropout)
        self.norm_cross = nn.LayerNorm(width)
        self.ffn = feed_forward(width, ffn_dim, dropout)
        self.norm_ffn = nn.LayerNorm(width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, y: Tensor, prior: Tensor | None, allowed: Tensor, memory_kv: tuple[Tensor, Tensor],
                memory_mask: Tensor, state: ACFLayerState | None) -> tuple[Tensor, Tensor, ACFLayerState]:
        rows, cluster_state = self.clusters.causal_rows(y, None if state is None else state.clusters)
        clusters = stack_clusters(rows, prior)
        h, (k, v) = self.attention(y, clusters, allowed, None if state is None else (state.keys, state.values))
        y = self.norm_attention(y + self.dropout(h))
        y = self.norm_cross(y + self.dropout(self.cross(y, *memory_kv, memory_mask)))
        y = self.norm_ffn(y + self.dropout(self.ffn(y)))
        return y, clusters, ACFLayerState(k, v, cluster_state)


class ACFDecoderCache(NamedTuple):
    layers: tuple[ACFLayerState, ...]
    memory_kv: tuple[tuple[Tensor, Tensor], ...]
    memory_mask: Tensor  # [B, 1, 1, M] bool

    @property
    def length(self) -> int:
        return self.layers[0].keys.shape[2]


def causal_key_mask(key_valid: Tensor, t_new: int) -> Tensor:
    """[B, T_new, T] bool: key s <= query position and (s is a real token or s is the query itself).

    Letting a padding query see itself keeps every softmax row non-empty; real queries never see padding.
    """
    t_total = key_valid.shape[1]
    keys = torch.arange(t_total, device=key_valid.device)[None, :]
    queries = torch.arange(t_total - t_new, t_total, device=key_valid.device)[:, None]
    return (keys <= queries) & (key_valid[:, None, :] | (keys == queries))


class ACFDecoder(nn.Module):
    """Decoder head with causal adaptive-clustering self-attention (decoder_api contract).

    forward(input_ids [B, T_new], attention_mask [B, T_past + T_new], memory [B, M, width],
            memory_mask [B, M], past=None, use_cache=False) -> DecoderOutput(logits [B, T_new, V], past)
    reorder_cache(past, index [B']) -> past
    """

    def __init__(self, cfg: DecoderConfig, vocab_size: int, width: int):
        super().__init__()
        check_decoder_config(cfg, width)
        self.width = width
        self.embedding = TextEmbedding(vocab_size, width, cfg.max_positions, cfg.dropout)
        self.layers = nn.ModuleList(
            ACFDecoderLayer(width, cfg.heads, cfg.ffn_dim, cfg.dropout) for _ in range(cfg.layers))
        self.lm_head = nn.Linear(width, vocab_size)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embedding.token.weight

    def forward(self, input_ids: Tensor, attention_mask: Tensor, memory: Tensor, memory_mask: Tensor,
                past: ACFDecoderCache | None = None, use_cache: bool = False) -> DecoderOutput:
        past_len = 0 if past is None else past.length
        check_decoder_inputs(input_ids, attention_mask, None if past is not None else memory, memory_mask,
                             past_len, self.width)
        if past is None:
            memory_kv = tuple(layer.cross.project_memory(memory) for layer in self.layers)
            mem_mask = memory_mask.bool()[:, None, None, :]
        else:
            memory_kv, mem_mask = past.memory_kv, past.memory_mask
        allowed = causal_key_mask(attention_mask.bool(), input_ids.shape[1])
        y = self.embedding(input_ids, past_len)
        clusters, states = None, []
        for i, layer in enumerate(self.layers):
            y, clusters, state = layer(y, clusters, allowed, memory_kv[i], mem_mask,
                                       None if past is None else past.layers[i])
            states.append(state)
        new_past = ACFDecoderCache(tuple(states), memory_kv, mem_mask) if use_cache else None
        return DecoderOutput(logits=self.lm_head(y), past=new_past)

    @staticmethod
    def reorder_cache(past: ACFDecoderCache, index: Tensor) -> ACFDecoderCache:
        return select_batch_rows(past, index)
