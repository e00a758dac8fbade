"""Decoding and sequence scoring for any ``decoder_api`` decoder (captioning, VQA, video, SCST).

Sequences are the generated tokens WITHOUT the leading BOS: [N, L], the first EOS included, PAD after it.
Log-probabilities are those of the model at temperature 1 (log softmax of the logits).

greedy_search     argmax decoding with the KV cache.
beam_search       batched beam search with the cache. Beams are ranked by summed log-prob while searching;
                  a beam that emitted EOS is kept (extended by PAD at zero cost) and competes with the
                  live ones; the final ranking divides by length ** length_penalty ("power" form; or the
                  GNMT form ((5 + length) / 6) ** length_penalty; length = tokens up to and including EOS).
                  It runs until every beam ended, or with early_stopping until the best normalized beam
                  ended. Beam size 1 is exactly greedy. (The official mPLUG rule: ``beam_official.py``.)
sample            ``num_samples`` draws per input (temperature, optional top-k / top-p), with their log-probs.
sample_with_grad  the same draws (temperature 1) with autograd on: summed log-probs WITH gradient (one-pass SCST).
sequence_log_probs  summed log-probs of given sequences under teacher forcing, WITH gradient (SCST).
score_candidates  rank candidate answers per input by summed log-prob (optionally prefiltered to the top-k
                  by first-token probability, as ALBEF/mPLUG ``rank_answer``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mplug_pretrain.models.decoders.api import BOS_ID, EOS_ID, PAD_ID


@dataclass
class BeamOutput:
    sequences: torch.Tensor  # [B, num_return, L]
    scores: torch.Tensor  # [B, num_return] length-normalized summed log-probs, best first


def _start(memory: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((rows, 1), BOS_ID, dtype=torch.long, device=memory.device)
    return tokens, torch.ones_like(tokens)


def _next_logits(decoder: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, memory: torch.Tensor,
                 memory_mask: torch.Tensor, past):
    out = decoder(tokens, mask, memory, memory_mask, past=past, use_cache=True)
    return out.logits[:, -1].float(), out.past


def _block(scores: torch.Tensor, block_eos: bool) -> torch.Tensor:
    """Never generate PAD; no EOS before ``min_length`` tokens."""
    scores[:, PAD_ID] = float("-inf")
    if block_eos:
        scores[:, EOS_ID] = float("-inf")
    return scores


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of ``probs`` [N, V] (rows sum to 1), by inverse CDF: the first index whose cumulative
    probability exceeds u ~ U[0, total). Same distribution as ``torch.multinomial(probs, 1)``, which on CPU
    takes ~60 ms for 40 rows of a 30,522-word vocabulary (half of an SCST step); this takes ~2 ms.
    A zero-probability index is never drawn: the cumulative sum does not rise there. -> [N] long."""
    cumulative = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cumulative.dtype)
    index = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True)
    return index.squeeze(1).clamp_max(probs.shape[1] - 1)


def _finish(sequence_steps: list[torch.Tensor], rows: int, device: torch.device) -> torch.Tensor:
    if not sequence_steps:
        return torch.empty(rows, 0, dtype=torch.long, device=device)
    return torch.stack(sequence_steps, dim=1)


@torch.no_grad()
def greedy_search(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor, max_length: int = 20,
                  min_length: int = 0) -> torch.Tensor:
    """-> sequences [B, L <= max_length]."""
    b = memory.shape[0]
    tokens, mask = _start(memory, b)
    finished = torch.zeros(b, dtype=torch.bool, device=memory.device)
    past, steps = None, []
    for t in range(max_length):
        logits, past = _next_logits(decoder, tokens, mask, memory, memory_mask, past)
        log_probs = _block(logits.log_softmax(-1), t < min_length)
        token = log_probs.argmax(-1).masked_fill(finished, PAD_ID)
        steps.append(token)
        finished |= token == EOS_ID
        if bool(finished.all()):
            break
        tokens, mask = token[:, None], torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return _finish(steps, b, memory.device)


LENGTH_PENALTY_FORMS = ("power", "gnmt")


def expand_memory(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor,
                  rows_per_input: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory for ``rows_per_input`` consecutive decoder rows per input (beams, samples): as it is when the
    decoder shares memory rows (``memory_rows_shared``: its keys and values are then computed once per input),
    else repeated to [B * rows_per_input, ...]."""
    if getattr(decoder, "memory_rows_shared", False) or rows_per_input == 1:
        return memory, memory_mask
    return memory.repeat_interleave(rows_per_input, 0), memory_mask.repeat_interleave(rows_per_input, 0)


def beam_start(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor, beam_size: int,
               num_return: int):
    """memory [B, M, D] -> (memory and memory_mask for B*k beam rows (``expand_memory``), BOS tokens and mask
    [B*k, 1], summed log-probs [B, k]: 0 for the first beam, -inf for the others, which start identical to it)."""
    if not 1 <= num_return <= beam_size:
        raise ValueError(f"num_return must be in [1, beam_size={beam_size}], got {num_return}")
    b = memory.shape[0]
    memory, memory_mask = expand_memory(decoder, memory, memory_mask, beam_size)
    tokens, mask = _start(memory, b * beam_size)
    scores = torch.zeros(b, beam_size, device=memory.device)
    scores[:, 1:] = float("-inf")
    return memory, memory_mask, tokens, mask, scores


def length_normalizer(lengths: torch.Tensor, length_penalty: float, form: str = "power") -> torch.Tensor:
    """The divisor of a summed log-prob: length ** length_penalty ("power") or ((5 + length) / 6) ** length_penalty
    ("gnmt", Wu et al. 2016). lengths: any shape of token counts (EOS included; at least 1 is used)."""
    lengths = lengths.clamp(min=1).float()
    if form == "power":
        return lengths ** length_penalty
    if form == "gnmt":
        return ((5.0 + lengths) / 6.0) ** length_penalty
    raise ValueError(f"length penalty form must be one of {LENGTH_PENALTY_FORMS}, got {form!r}")


@torch.no_grad()
def beam_search(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor, beam_size: int = 5,
                max_length: int = 20, min_length: int = 0, length_penalty: float = 1.0,
                num_return: int = 1, length_penalty_form: str = "power", early_stopping: bool = False) -> BeamOutput:
    """Batched beam search; returns the ``num_return`` best of ``beam_size`` beams per input."""
    b, k = memory.shape[0], beam_size
    n = b * k
    memory, memory_mask, tokens, mask, scores = beam_start(decoder, memory, memory_mask, beam_size, num_return)
    finished = torch.zeros(n, dtype=torch.bool, device=memory.device)
    lengths = torch.zeros(n, dtype=torch.long, device=memory.device)
    sequences = torch.empty(n, 0, dtype=torch.long, device=memory.device)
    past = None
    for t in range(max_length):
        logits, past = _next_logits(decoder, tokens, mask, memory, memory_mask, past)
        log_probs = _block(logits.log_softmax(-1), t < min_length)
        log_probs[finished] = float("-inf")
        log_probs[finished, PAD_ID] = 0.0
        vocab = log_probs.shape[-1]
        candidates = (scores.view(n, 1) + log_probs).view(b, k * vocab)
        scores, flat = candidates.topk(k, dim=1)
        source = (torch.arange(b, device=memory.device)[:, None] * k + flat // vocab).view(-1)
        token = (flat % vocab).view(-1)
        sequences = torch.cat([sequences[source], token[:, None]], dim=1)
        lengths = lengths[source] + (~finished[source]).long()
        finished = finished[source] | (token == EOS_ID)
        if early_stopping:  # an input whose best normalized beam ended stops: freeze all its beams
            normalized = scores / length_normalizer(lengths.view(b, k), length_penalty, length_penalty_form)
            best_ended = finished.view(b, k).gather(1, normalized.argmax(1, keepdim=True))
            finished = (finished.view(b, k) | best_ended).view(-1)
        if bool(finished.all()):
            break
        if k > 1:  # one beam never moves: nothing to reorder
            past = decoder.reorder_cache(past, source)
            mask = mask[source]
        tokens, mask = token[:, None], torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    normalized = scores / length_normalizer(lengths.view(b, k), length_penalty, length_penalty_form)
    order = normalized.argsort(dim=1, descending=True)[:, :num_return]
    best = (torch.arange(b, device=memory.device)[:, None] * k + order).view(-1)
    return BeamOutput(sequences[best].view(b, num_return, -1), normalized.gather(1, order))


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def sample(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor, num_samples: int = 5,
           max_length: int = 20, min_length: int = 0, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sequences [B * num_samples, L], log_probs [B * num_samples]); rows of input i are i*n .. i*n+n-1."""
    return _sample(decoder, memory, memory_mask, num_samples, max_length, min_length, temperature, top_k, top_p,
                   generator)


def sample_with_grad(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor, num_samples: int = 5,
                     max_length: int = 20, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` (temperature 1, full softmax) with autograd on: log_probs [B * num_samples] carry a graph back
    to ``memory`` and the decoder's parameters, so SCST needs no teacher-forced recomputation. Equals
    ``sample`` then ``sequence_log_probs`` for the same random draws (tests/tasks/caption/test_caption_scst_one_pass.py)."""
    with torch.enable_grad():
        return _sample(decoder, memory, memory_mask, num_samples, max_length, 0, 1.0, 0, 1.0, generator)


def _sample(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor, num_samples: int, max_length: int,
            min_length: int, temperature: float, top_k: int, top_p: float,
            generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n = memory.shape[0] * num_samples
    memory, memory_mask = expand_memory(decoder, memory, memory_mask, num_samples)
    tokens, mask = _start(memory, n)
    finished = torch.zeros(n, dtype=torch.bool, device=memory.device)
    total = torch.zeros(n, device=memory.device)
    past, steps = None, []
    for t in range(max_length):
        logits, past = _next_logits(decoder, tokens, mask, memory, memory_mask, past)
        # the draw needs no graph (sample_with_grad); the sum and the mask below change out of place for autograd
        probs = _filter_logits(_block(logits.detach() / temperature, t < min_length), top_k, top_p).softmax(-1)
        token = draw(probs, generator).masked_fill(finished, PAD_ID)
        step_lp = logits.log_softmax(-1).gather(1, token[:, None]).squeeze(1)
        total = total + step_lp.masked_fill(finished, 0.0)
        steps.append(token)
        finished = finished | (token == EOS_ID)  # masked_fill saved the old mask for backward
        if bool(finished.all()):
            break
        tokens, mask = token[:, None], torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return _finish(steps, n, memory.device), total


def token_mask(sequences: torch.Tensor) -> torch.Tensor:
    """1 for every generated token up to and including the first EOS, 0 for the PAD after it."""
    after_eos = (sequences == EOS_ID).long().cumsum(1) - (sequences == EOS_ID).long()
    return ((after_eos == 0) & (sequences != PAD_ID)).long()


def sequence_log_probs(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor,
                       sequences: torch.Tensor) -> torch.Tensor:
    """Summed log p(sequence | memory) [N] under teacher forcing, differentiable (SCST policy gradient).
    memory [N, M, D], or [N / g, M, D] shared by g consecutive sequences where the decoder allows it
    (``expand_memory``)."""
    valid = token_mask(sequences)
    bos = torch.full_like(sequences[:, :1], BOS_ID)
    inputs = torch.cat([bos, sequences[:, :-1]], dim=1)
    mask = torch.cat([torch.ones_like(bos), valid[:, :-1]], dim=1)
    logits = decoder(inputs, mask, memory, memory_mask).logits
    lp = logits.float().log_softmax(-1).gather(2, sequences[:, :, None]).squeeze(2)
    return (lp * valid).sum(1)


@torch.no_grad()
def score_candidates(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor,
                     candidate_ids: torch.Tensor, candidate_mask: torch.Tensor, k: int | None = None,
                     chunk_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank C candidates ([C, L]: "[CLS] answer [SEP]", right padded) for each of B inputs.

    -> (indices [B, K], scores [B, K]) best first, score = summed log-prob of the tokens after [CLS];
    K = C, or K = k when ``k`` is given: then only the k candidates whose first token is most probable are
    scored in full (approximation used by ALBEF / mPLUG answer ranking).
    """
    b, c = memory.shape[0], candidate_ids.shape[0]
    if k is not None and k < c:
        first_logits, _ = _next_logits(decoder, *_start(memory, b), memory, memory_mask, None)
        first = first_logits.log_softmax(-1)[:, candidate_ids[:, 1]]  # [B, C]
        chosen = first.topk(k, dim=1).indices  # [B, k]
    else:
        chosen = torch.arange(c, device=memory.device).expand(b, c)
    pairs_input = chosen.reshape(-1)
    pairs_row = torch.arange(b, device=memory.device).repeat_interleave(chosen.shape[1])
    scores = torch.empty(pairs_input.shape[0], device=memory.device)
    for start in range(0, pairs_input.shape[0], chunk_size):
        rows, cands = pairs_row[start:start + chunk_size], pairs_input[start:start + chunk_size]
        ids, mask = candidate_ids[cands], candidate_mask[cands]
        logits = decoder(ids, mask, memory[rows], memory_mask[rows]).logits
        lp = F.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)
        scores[start:start + chunk_size] = (lp * mask[:, 1:]).sum(1)
    scores = scores.view(b, -1)
    order = scores.argsort(dim=1, descending=True)
    return chosen.gather(1, order), scores.gather(1, order)
