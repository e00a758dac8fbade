"""mPLUG's text decoder: a BERT LM with causal self-attention and cross-attention to the fused memory.

Implements ``decoder_api``: forward(input_ids [B, T_new], attention_mask [B, T_past + T_new], memory [B, M, D],
memory_mask [B, M], past=None, use_cache=False, vocab=None) -> DecoderOutput(logits [B, T_new, V], past).
Per layer (post-LN, as BERT):  x = LN(x + CausalSelfAttn(x));  x = LN(x + CrossAttn(x, memory));
x = LN(x + FFN(x)).  Token i may attend to keys j <= T_past + i that are not padding.
``right_padded=True`` (the caller knows every row's padding is at its end, e.g. PrefixLM targets): without a
cache the self-attention runs with SDPA's ``is_causal`` and no bias, the mask flash and cuDNN attention accept.
Exact for every real token (its keys j <= i are all real); a padding position's output differs (it may attend
to earlier padding), which the losses ignore.
Cache (``BertDecoderCache``): per layer the self-attention keys/values of every token so far, and the
cross-attention keys/values of the memory, computed once on the first call.
Shared memory rows (``memory_rows_shared``): memory [B / g, M, D] and memory_mask [B / g, M] may serve g
consecutive input rows each (the beams or samples of one image): the memory's keys and values are computed
and cached once per image instead of once per beam, and ``reorder_cache`` leaves them alone (beam search only
reorders rows within an image).
Logits come from ``LMPredictionHead`` tied to the decoder's word embeddings (``tie_word_embeddings``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mplug_pretrain.models.decoders.api import DecoderOutput
from mplug_pretrain.models.heads.lm_head import LMPredictionHead
from mplug_pretrain.models.layers.attention import (
    bias_from_keep,
    causal_keep,
    key_padding_bias,
    to_autocast_dtype,
)
from mplug_pretrain.models.layers.bert_init import bert_init_
from mplug_pretrain.models.layers.checkpointing import run_layer
from mplug_pretrain.models.model_config import DecoderConfig
from mplug_pretrain.models.towers.text import BertEmbeddings, BertLayer

LayerCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # self k, self v, cross k, cross v


@dataclass
class BertDecoderCache:
    layers: list[LayerCache]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0


def causal_bias(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[B, T_total] padding mask -> bias [B, 1, new_tokens, T_total] for the last ``new_tokens`` queries."""
    keep = causal_keep(new_tokens, attention_mask.shape[1], attention_mask.device)[None] & attention_mask[:, None, :].bool()
    return bias_from_keep(keep[:, None])


class BertDecoder(nn.Module):
    """See the module docstring. Built by ``decoder_factory.build_decoder(cfg, vocab_size, width)``."""

    memory_rows_shared = True  # decoder_api: memory may have B / g rows (generation.expand_memory)

    def __init__(self, cfg: DecoderConfig, vocab_size: int, width: int):
        super().__init__()
        self.embeddings = BertEmbeddings(vocab_size, width, cfg.max_positions, cfg.dropout)
        self.layers = nn.ModuleList(BertLayer(width, cfg.heads, cfg.ffn_dim, cfg.dropout, cross_attention=True)
                                    for _ in range(cfg.layers))
        self.head = LMPredictionHead(width, vocab_size, tied=cfg.tie_word_embeddings)
        bert_init_(self)
        self.grad_checkpointing = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, memory: torch.Tensor,
                memory_mask: torch.Tensor | None, past: BertDecoderCache | None = None,
                use_cache: bool = False, right_padded: bool = False, vocab: slice | None = None) -> DecoderOutput:
        past_len = past.length if past is not None else 0
        b, t = input_ids.shape
        if attention_mask.shape != (b, past_len + t):
            raise ValueError(f"attention_mask must be [B, T_past + T_new] = [{b}, {past_len + t}], "
                             f"got {tuple(attention_mask.shape)}")
        if past is None and (memory.shape[0] == 0 or b % memory.shape[0]):
            raise ValueError(f"memory has {memory.shape[0]} rows: it must have B = {b} rows or B / g rows "
                             "(g input rows sharing each memory row)")
        x = self.embeddings(input_ids, position_offset=past_len)
        memory = to_autocast_dtype(memory)  # one cast for every layer's cross-attention keys and values
        memory_bias = key_padding_bias(memory_mask)
        if past is None and not use_cache:
            self_bias = None if right_padded else causal_bias(attention_mask, t)
            for layer in self.layers:
                x = run_layer(layer, x, self_bias, memory, memory_bias, is_causal=right_padded,
                              enabled=self.grad_checkpointing)
            return DecoderOutput(self.head(x, self.embeddings.word_embeddings.weight, vocab=vocab), None)
        self_bias = causal_bias(attention_mask, t)
        caches = []
        for i, layer in enumerate(self.layers):
            x, cache = self._cached_layer(layer, x, self_bias, memory, memory_bias,
                                          past.layers[i] if past is not None else None)
            caches.append(cache)
        logits = self.head(x, self.embeddings.word_embeddings.weight, vocab=vocab)
        return DecoderOutput(logits, BertDecoderCache(caches) if use_cache else None)

    @staticmethod
    def _cached_layer(layer: BertLayer, x: torch.Tensor, self_bias: torch.Tensor, memory: torch.Tensor,
                      memory_bias: torch.Tensor | None, past: LayerCache | None) -> tuple[torch.Tensor, LayerCache]:
        k, v = layer.attn.keys_values(x)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            cross_k, cross_v = past[2], past[3]
        else:  # contiguous once: each step's attention over strided keys/values costs ~1.5x (CPU SDPA copies)
            cross_k, cross_v = (t.contiguous() for t in layer.cross_attn.keys_values(memory))
        x = layer.self_attention(x, self_bias, kv=(k, v))
        x = layer.cross_attention(x, None, memory_bias, kv=(cross_k, cross_v))
        return layer.feed_forward(x), (k, v, cross_k, cross_v)

    @staticmethod
    def reorder_cache(past: BertDecoderCache, index: torch.Tensor) -> BertDecoderCache:
        """Select rows ``index`` [B'] of the self-attention cache; cross-attention keys/values with fewer rows
        than the cache (a memory shared by groups of rows) stay as they are: ``index`` keeps rows in their group."""
        layers = []
        for k, v, cross_k, cross_v in past.layers:
            if cross_k.shape[0] == k.shape[0]:
                cross_k, cross_v = cross_k.index_select(0, index), cross_v.index_select(0, index)
            layers.append((k.index_select(0, index), v.index_select(0, index), cross_k, cross_v))
        return BertDecoderCache(layers)
