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
cfg.acf_formula = "official": the official estimator (models/acf.py); the layer hands its stacked merge
probabilities M~(m) [B, T, T_new] (not C~(m)) to the next layer, and C(m) is used as is.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.acf.clustering import (
    FORMULAS,
    ClusteredSelfAttention,
    ClusterEstimator1D,
    ClusterState,
    stack_clusters,
)
from mplug_pretrain.models.decoders.api import DecoderOutput
from mplug_pretrain.models.decoders.expansionnet.decoder import (
    CrossAttention,
    TextEmbedding,
    check_decoder_config,
    check_decoder_inputs,
    feed_forward,
    init_and_tie,
    memory_keys_values,
    project_to_vocab,
    select_batch_rows,
)
from mplug_pretrain.models.model_config import DecoderConfig


class ACFLayerState(NamedTuple):
    keys: Tensor  # [B, h, T, d/h]
    values: Tensor  # [B, h, T, d/h]
    clusters: ClusterState


class ACFDecoderLayer(nn.Module):
    """y [B, T_new, d], prior or None -> (y, cluster rows [B, T_new, T] used by the attention, state, next prior).

    paper: prior = rows of C~(m-1), cluster rows = next prior = C~(m). official: prior = the previous layer's
    merge probabilities M~(m-1) [B, T, T_new] ([i, k] for the new columns k), cluster rows = C(m).
    """

    def __init__(self, width: int, heads: int, ffn_dim: int, dropout: float, formula: str = "paper"):
        super().__init__()
        self.official = formula == "official"
        self.clusters = ClusterEstimator1D(width, formula)
        self.attention = ClusteredSelfAttention(width, heads, dropout)
        self.norm_attention = nn.LayerNorm(width)
        self.cross = CrossAttention(width, heads, dropout)
        self.norm_cross = nn.LayerNorm(width)
        self.ffn = feed_forward(width, ffn_dim, dropout)
        self.norm_ffn = nn.LayerNorm(width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, y: Tensor, prior: Tensor | None, allowed: Tensor, memory_kv: tuple[Tensor, Tensor],
                memory_mask: Tensor, state: ACFLayerState | None) -> tuple[Tensor, Tensor, ACFLayerState, Tensor]:
        past = None if state is None else state.clusters
        if self.official:
            clusters, cluster_state, next_prior = self.clusters.causal_rows(y, past, prior)
        else:
            rows, cluster_state, _ = self.clusters.causal_rows(y, past)
            clusters = next_prior = stack_clusters(rows, prior)
        h, (k, v) = self.attention(y, clusters, allowed, None if state is None else (state.keys, state.values))
        y = self.norm_attention(y + self.dropout(h))
        y = self.norm_cross(y + self.dropout(self.cross(y, *memory_kv, memory_mask)))
        y = self.norm_ffn(y + self.dropout(self.ffn(y)))
        return y, clusters, ACFLayerState(k, v, cluster_state), next_prior


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
    """Decoder head with causal adaptive-clustering self-attention; ``forward`` and ``reorder_cache`` as
    ``decoder_api`` states them (the cache: ``ACFDecoderCache``)."""

    def __init__(self, cfg: DecoderConfig, vocab_size: int, width: int):
        super().__init__()
        check_decoder_config(cfg, width)
        formula = getattr(cfg, "acf_formula", "paper")
        if formula not in FORMULAS:
            raise ConfigError(f"decoder.acf_formula: expected paper | official, got {formula!r}")
        self.width = width
        self.embedding = TextEmbedding(vocab_size, width, cfg.max_positions, cfg.dropout)
        self.layers = nn.ModuleList(
            ACFDecoderLayer(width, cfg.heads, cfg.ffn_dim, cfg.dropout, formula) for _ in range(cfg.layers))
        self.lm_head = nn.Linear(width, vocab_size)
        init_and_tie(self, cfg.tie_word_embeddings)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, memory: Tensor, memory_mask: Tensor,
                past: ACFDecoderCache | None = None, use_cache: bool = False,
                vocab: slice | None = None) -> DecoderOutput:
        past_len = 0 if past is None else past.length
        check_decoder_inputs(input_ids, attention_mask, None if past is not None else memory, memory_mask,
                             past_len, self.width)
        memory_kv, mem_mask = memory_keys_values(self.layers, memory, memory_mask, past)
        allowed = causal_key_mask(attention_mask.bool(), input_ids.shape[1])
        y = self.embedding(input_ids, past_len)
        prior, states = None, []
        for i, layer in enumerate(self.layers):
            y, _, state, prior = layer(y, prior, allowed, memory_kv[i], mem_mask,
                                       None if past is None else past.layers[i])
            states.append(state)
        new_past = ACFDecoderCache(tuple(states), memory_kv, mem_mask) if use_cache else None
        return DecoderOutput(logits=project_to_vocab(self.lm_head, y, vocab), past=new_past)

    @staticmethod
    def reorder_cache(past: ACFDecoderCache, index: Tensor) -> ACFDecoderCache:
        return select_batch_rows(past, index)
