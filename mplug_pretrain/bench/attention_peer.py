"""`mplug bench attention-peer`: forward + backward time of our BERT stacks against transformers' BERT at the
same sizes, both in training mode (dropout 0.1), fp32, random weights, CPU.

- text encoder: our TextEncoder (models/towers/text.py) vs ``BertModel(add_pooling_layer=False)``: base width (768,
  12 heads, FFN 3072), 6 layers, batch 8, 30 tokens with padding (lengths 12..30);
- decoder: our BertDecoder (models/decoders/bert.py: causal self-attention + cross-attention + tied LM head) vs
  ``BertLMHeadModel(is_decoder=True, add_cross_attention=True)``: 12 layers, batch 8, 40 tokens, memory of
  257 image + 30 text states (the base preset's fused memory).
Loss for both: sum of the encoder states / cross-entropy of the decoder logits on random labels, then backward.
seconds = median over 15 interleaved rounds (``bench.common.interleaved_seconds``: each round times every case
once, ours and transformers back to back, the order reversed every other round, so load changes hit both
alike); also each side's minimum (the figure least touched by other processes) and the median of the 15
per-round ratios.
Rows: module, layers, batch, tokens, ours_seconds, transformers_seconds, ratio (transformers / ours; > 1 means
we are faster), ours_min_seconds, transformers_min_seconds, ratio_of_min, ratio_per_round_median,
transformers_attn_implementation, rounds.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mplug_pretrain.bench.common import interleaved_seconds, write_bench
from mplug_pretrain.models.decoders.bert import BertDecoder
from mplug_pretrain.models.model_config import DecoderConfig
from mplug_pretrain.models.towers.text import TextEncoder

VOCAB = 30522  # bert-base-uncased WordPiece


def _bert_config(width: int, heads: int, ffn: int, layers: int, decoder: bool, vocab: int):
    from transformers import BertConfig
    return BertConfig(vocab_size=vocab, hidden_size=width, num_attention_heads=heads, intermediate_size=ffn,
                      num_hidden_layers=layers, is_decoder=decoder, add_cross_attention=decoder,
                      attn_implementation="sdpa")


def _padding_mask(batch: int, tokens: int, shortest: int) -> torch.Tensor:
    lengths = torch.linspace(shortest, tokens, batch).long()
    return (torch.arange(tokens)[None, :] < lengths[:, None]).long()


def _encoder_cases(width: int, heads: int, ffn: int, layers: int, batch: int, tokens: int, vocab: int):
    from transformers import BertModel
    ids = torch.randint(1, vocab, (batch, tokens))
    mask = _padding_mask(batch, tokens, max(2, tokens * 2 // 5))
    ours = TextEncoder(vocab, width, heads, ffn, layers, 512, 0.1).train()
    peer = BertModel(_bert_config(width, heads, ffn, layers, False, vocab), add_pooling_layer=False).train()

    def run_ours() -> None:
        ours(ids, mask).sum().backward()

    def run_peer() -> None:
        peer(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    return run_ours, run_peer, peer


def _decoder_cases(width: int, heads: int, ffn: int, layers: int, batch: int, tokens: int, memory_len: int,
                   vocab: int):
    from transformers import BertLMHeadModel
    ids = torch.randint(1, vocab, (batch, tokens))
    labels = torch.randint(1, vocab, (batch, tokens))
    mask = _padding_mask(batch, tokens, max(2, tokens // 2))
    memory = torch.randn(batch, memory_len, width)
    memory_mask = torch.ones(batch, memory_len, dtype=torch.long)
    memory_mask[: batch // 2, -memory_len // 10:] = 0  # padded text part of the memory, as in mPLUG
    ours = BertDecoder(DecoderConfig(layers=layers, heads=heads, ffn_dim=ffn), vocab, width).train()
    peer = BertLMHeadModel(_bert_config(width, heads, ffn, layers, True, vocab)).train()

    def run_ours() -> None:
        logits = ours(ids, mask, memory, memory_mask).logits
        F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1)).backward()

    def run_peer() -> None:
        logits = peer(input_ids=ids, attention_mask=mask, encoder_hidden_states=memory,
                      encoder_attention_mask=memory_mask).logits
        F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1)).backward()
    return run_ours, run_peer, peer


def run(out: str, quick: bool = False) -> dict:
    """quick=True (test suite): width 128, 2 heads, 2 layers, vocabulary 1000, one round."""
    torch.manual_seed(0)
    vocab = 1000 if quick else VOCAB
    width, heads, ffn = (128, 2, 512) if quick else (768, 12, 3072)
    enc_layers, dec_layers = (2, 2) if quick else (6, 12)
    rounds, warmup = (1, 0) if quick else (15, 1)
    batch, enc_tokens, dec_tokens, memory_len = 8, 30, 40, 257 + 30
    cases: list[tuple[dict, Callable[[], None], Callable[[], None], object]] = [
        ({"module": "text_encoder", "layers": enc_layers, "batch": batch, "tokens": enc_tokens},
         *_encoder_cases(width, heads, ffn, enc_layers, batch, enc_tokens, vocab)),
        ({"module": "bert_decoder", "layers": dec_layers, "batch": batch, "tokens": dec_tokens,
          "memory_tokens": memory_len}, *_decoder_cases(width, heads, ffn, dec_layers, batch, dec_tokens, memory_len,
                                                          vocab)),
    ]
    fns = {(i, side): fn for i, (_, run_ours, run_peer, _) in enumerate(cases)
           for side, fn in (("peer", run_peer), ("ours", run_ours))}
    times = interleaved_seconds(fns, rounds=rounds, warmup=warmup)
    rows = []
    for i, (fields, _, _, peer) in enumerate(cases):
        ours_s, peer_s = statistics.median(times[(i, "ours")]), statistics.median(times[(i, "peer")])
        ours_min, peer_min = min(times[(i, "ours")]), min(times[(i, "peer")])
        rows.append({**fields, "width": width, "vocab": vocab, "ours_seconds": ours_s, "transformers_seconds": peer_s,
                     "ratio": peer_s / ours_s, "ours_min_seconds": ours_min, "transformers_min_seconds": peer_min,
                     "ratio_of_min": peer_min / ours_min, "ratio_per_round_median": statistics.median(
                         p / o for o, p in zip(times[(i, "ours")], times[(i, "peer")])),
                     "transformers_attn_implementation": peer.config._attn_implementation, "rounds": rounds})
    import transformers
    return write_bench("attention_peer", rows, out, quick=quick, transformers=transformers.__version__,
                       mode="train (dropout 0.1), forward + backward, fp32")
