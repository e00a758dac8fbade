"""`mplug bench generate`: captions per second of beam search (beam 1 / 3 / 5) with and without the KV cache,
for the bert, expansion and acf decoders at the same width and depth, on one fixed random memory.

    memory   [B, M, D] random (M = 257 visual + 5 prompt tokens, as a base model with "a picture of")
    decoding exactly ``length`` tokens per caption (min_length = max_length, EOS blocked), so every decoder
             does the same number of steps whatever its random weights prefer
    cache    True: the decoders' incremental cache (models.generation), decoded as our evaluation decodes:
             inside ``packed_for_decoding`` (on CPU the weights are packed once for the block;
             models.packed_decoding); False: ``FullRecompute`` wraps the decoder and re-runs the whole prefix at
             every step (what decoding without a cache costs), plain products
    captions_per_s = B / median seconds of one ``beam_search`` call over B memories
Extra rows (``implementation: transformers``): Hugging Face ``BertLMHeadModel`` (BERT decoder with
cross-attention, same sizes, random weights) through ``generate`` (num_beams, use_cache) against our
beam search over our bert decoder (``implementation: ours``). Random weights on both sides; the work is
fixed by the forced length. fp32. With the cache, ours packed, ours unpacked (``packed: false``) and
transformers are timed in ``rounds`` interleaved rounds per beam width (``bench.common.interleaved_seconds``);
the packed row's ``first_call_captions_per_s`` is the block's first call, the packing included.
``MPLUG_BENCH_GENERATE_CACHE=on`` keeps only the cached rows (``cache_modes_from_env``).
"""
from __future__ import annotations

import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from mplug_pretrain.bench.common import interleaved_seconds, median_seconds, write_bench
from mplug_pretrain.models.decoders.api import BOS_ID, EOS_ID, PAD_ID, DecoderOutput
from mplug_pretrain.models.generation.packed_decoding import packed_for_decoding

DECODERS = ("bert", "expansion", "acf")
BEAMS = (1, 3, 5)
VOCAB = 30522


@dataclass
class Size:
    width: int
    layers: int
    heads: int
    ffn: int
    memory_tokens: int
    batch: int
    length: int
    repeats: int
    rounds: int


FULL = Size(width=768, layers=6, heads=12, ffn=3072, memory_tokens=262, batch=4, length=20, repeats=2, rounds=7)
QUICK = Size(width=64, layers=1, heads=2, ffn=128, memory_tokens=10, batch=2, length=4, repeats=1, rounds=1)


class FullRecompute(nn.Module):
    """A decoder without its cache: the "past" is the token prefix, re-run in full at every step."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids, attention_mask, memory, memory_mask, past=None, use_cache=False) -> DecoderOutput:
        tokens = input_ids if past is None else torch.cat([past, input_ids], dim=1)
        logits = self.decoder(tokens, attention_mask, memory, memory_mask).logits[:, -input_ids.shape[1]:]
        return DecoderOutput(logits, tokens if use_cache else None)

    @staticmethod
    def reorder_cache(past: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return past.index_select(0, index)


def build_decoder(kind: str, size: Size) -> nn.Module:
    from mplug_pretrain.models.decoders.factory import build_decoder as factory
    from mplug_pretrain.models.model_config import DecoderConfig
    cfg = DecoderConfig(type=kind, layers=size.layers, heads=size.heads, ffn_dim=size.ffn, dropout=0.0)
    return factory(cfg, vocab_size=VOCAB, width=size.width).eval()


def _ours_call(decoder: nn.Module, memory: torch.Tensor, mask: torch.Tensor, beam: int, size: Size):
    from mplug_pretrain.models.generation.decoding import beam_search

    @torch.no_grad()
    def once() -> None:
        out = beam_search(decoder, memory, mask, beam_size=beam, max_length=size.length, min_length=size.length)
        assert out.sequences.shape[-1] == size.length
    return once


def _transformers_call(model: nn.Module, memory: torch.Tensor, mask: torch.Tensor, beam: int, cache: bool,
                       size: Size):
    from transformers import DynamicCache, EncoderDecoderCache
    ids = torch.full((memory.shape[0], 1), BOS_ID, dtype=torch.long)

    @torch.no_grad()
    def once() -> None:
        # a decoder-only config would get a plain DynamicCache, which BERT's cross-attention cannot use
        extra = {"past_key_values": EncoderDecoderCache(DynamicCache(), DynamicCache())} if cache else {}
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), encoder_hidden_states=memory,
                             encoder_attention_mask=mask, num_beams=beam, do_sample=False, use_cache=cache,
                             max_new_tokens=size.length, min_new_tokens=size.length, eos_token_id=EOS_ID,
                             pad_token_id=PAD_ID, bos_token_id=BOS_ID, **extra)
        assert out.shape[1] == size.length + 1
    return once


def _first_call_seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def hf_bert_decoder(size: Size) -> nn.Module:
    from transformers import BertConfig, BertLMHeadModel
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=size.width, num_hidden_layers=size.layers,
                     num_attention_heads=size.heads, intermediate_size=size.ffn, is_decoder=True,
                     add_cross_attention=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertLMHeadModel(cfg).eval()


def cache_modes_from_env(value: str | None) -> tuple[bool, ...]:
    """``MPLUG_BENCH_GENERATE_CACHE``: "on" (cached decoding only: the comparison with transformers, minutes),
    "off", or unset / "both" (every row; the recompute-everything rows take about ten minutes on one core)."""
    modes = {None: (True, False), "both": (True, False), "on": (True,), "off": (False,)}
    if value not in modes:
        raise ValueError(f"MPLUG_BENCH_GENERATE_CACHE: expected on, off or both, got {value!r}")
    return modes[value]


def run(out: str, quick: bool = False) -> dict:
    size = QUICK if quick else FULL
    torch.manual_seed(0)
    memory = torch.randn(size.batch, size.memory_tokens, size.width)
    mask = torch.ones(size.batch, size.memory_tokens, dtype=torch.long)
    decoders = {kind: build_decoder(kind, size) for kind in DECODERS}
    hf = hf_bert_decoder(size)
    rows = []

    def add(implementation: str, kind: str, beam: int, cache: bool, seconds: float, module: nn.Module,
            **extra) -> None:
        rows.append({"implementation": implementation, "decoder": kind, "beam": beam, "cache": cache,
                     "captions_per_s": size.batch / seconds, **extra,
                     "parameters": sum(p.numel() for p in module.parameters())})
        print(rows[-1], flush=True)

    for cache in cache_modes_from_env(os.environ.get("MPLUG_BENCH_GENERATE_CACHE")):
        for beam in BEAMS:
            if cache:  # ours packed and unpacked, and transformers, interleaved: the same load for all three
                bert = decoders["bert"]
                with packed_for_decoding(bert) as fast:
                    packed = _ours_call(fast, memory, mask, beam, size)
                    first = _first_call_seconds(packed)
                    times = interleaved_seconds({"packed": packed, "plain": _ours_call(bert, memory, mask, beam, size),
                                                 "transformers": _transformers_call(hf, memory, mask, beam, True, size)},
                                                rounds=size.rounds)
                seconds = {name: statistics.median(t) for name, t in times.items()}
                add("ours", "bert", beam, cache, seconds["packed"], bert, packed=fast is not bert,
                    first_call_captions_per_s=size.batch / first, rounds=size.rounds)
                add("ours", "bert", beam, cache, seconds["plain"], bert, packed=False, rounds=size.rounds)
                add("transformers", "bert", beam, cache, seconds["transformers"], hf, rounds=size.rounds)
            else:  # back to back: the same load for both
                wrapped = FullRecompute(decoders["bert"])
                add("ours", "bert", beam, cache,
                    median_seconds(_ours_call(wrapped, memory, mask, beam, size), repeats=size.repeats), wrapped)
                add("transformers", "bert", beam, cache, median_seconds(
                    _transformers_call(hf, memory, mask, beam, cache, size), repeats=size.repeats), hf)
        for kind in DECODERS[1:]:
            with packed_for_decoding(decoders[kind]) if cache else nullcontext(decoders[kind]) as decoder:
                wrapped = decoder if cache else FullRecompute(decoder)
                for beam in BEAMS:
                    add("ours", kind, beam, cache, median_seconds(_ours_call(wrapped, memory, mask, beam, size),
                                                                  repeats=size.repeats), decoders[kind],
                        packed=decoder is not decoders[kind])
    return write_bench("generate", rows, out, settings={**size.__dict__, "vocab": VOCAB, "dtype": "float32",
                                                        "threads": torch.get_num_threads()})
