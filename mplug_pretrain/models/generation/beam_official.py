"""The official mPLUG beam-search rule (AliceMind ``predictor.TextGenerator``), for reproducing published numbers.

What makes it differ from ``generation.beam_search``:
  * GNMT length penalty lp(L) = ((5 + L) / 6) ** alpha, L = tokens generated so far ([SEP] included);
  * a beam that emits [SEP] is copied, with score log p / lp(L), into the input's pool of finished hypotheses,
    and its slot keeps being extended like a live beam (its continuations compete for the beam's slots);
  * an input stops as soon as its best beam of the step has just emitted [SEP] (early stopping): every beam of
    that step joins the pool then, finished or not; at ``max_length`` every beam joins;
  * the answer is the pool's best score (ties: the earlier hypothesis).
Sequences come back without BOS, cut after their first [SEP] and PAD-padded; scores are the pool scores.
One deliberate difference: [PAD] is never generated (the official code allows it; a PAD inside a caption
would break the sequence convention of ``decoder_api``).
"""
from __future__ import annotations

import torch
from torch import nn

from mplug_pretrain.models.decoders.api import EOS_ID, PAD_ID
from mplug_pretrain.models.generation.decoding import BeamOutput, _next_logits, beam_start


def gnmt_length_penalty(length: int | torch.Tensor, alpha: float):
    """((5 + length) / 6) ** alpha (Wu et al. 2016), the divisor of a beam's summed log-prob."""
    return ((5.0 + length) / 6.0) ** alpha


def _cut_after_eos(sequence: list[int]) -> list[int]:
    return sequence[:sequence.index(EOS_ID) + 1] if EOS_ID in sequence else sequence


@torch.no_grad()
def mplug_official_beam_search(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor,
                               beam_size: int = 5, max_length: int = 20, min_length: int = 0, alpha: float = 0.6,
                               num_return: int = 1) -> BeamOutput:
    """memory [B, M, D], memory_mask [B, M] -> BeamOutput(sequences [B, num_return, L], scores [B, num_return])."""
    b, k = memory.shape[0], beam_size
    n = b * k
    memory, memory_mask, tokens, mask, log_scores = beam_start(decoder, memory, memory_mask, beam_size, num_return)
    sequences = torch.empty(n, 0, dtype=torch.long, device=memory.device)
    pools: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    done = [False] * b
    past = None
    for step in range(max_length):
        logits, past = _next_logits(decoder, tokens, mask, memory, memory_mask, past)
        log_probs = logits.log_softmax(-1)
        log_probs[:, PAD_ID] = float("-inf")
        if step < min_length:
            log_probs[:, EOS_ID] = -1e20
        penalty = gnmt_length_penalty(step + 1, alpha)
        vocab = log_probs.shape[-1]
        candidates = ((log_scores.view(n, 1) + log_probs) / penalty).view(b, k * vocab)
        normalized, flat = candidates.topk(k, dim=1)
        log_scores = normalized * penalty
        source = (torch.arange(b, device=memory.device)[:, None] * k + flat // vocab).view(-1)
        token = (flat % vocab).view(-1)
        sequences = torch.cat([sequences[source], token[:, None]], dim=1)
        finished = (token == EOS_ID).view(b, k)
        if step + 1 == max_length:
            finished[:] = True
        finished |= finished[:, :1].clone()  # the best beam ended: the whole input ends now
        for i in range(b):
            if done[i]:
                continue
            for j in finished[i].nonzero().view(-1).tolist():
                pools[i].append((normalized[i, j].item(), sequences[i * k + j].tolist()))
            done[i] = bool(finished[i, 0])
        if all(done):
            break
        past = decoder.reorder_cache(past, source)
        tokens, mask = token[:, None], torch.cat([mask[source], torch.ones_like(mask[:, :1])], dim=1)
    return _best_of_pools(pools, num_return, memory.device)


def _best_of_pools(pools: list[list[tuple[float, list[int]]]], num_return: int, device) -> BeamOutput:
    chosen = [sorted(pool, key=lambda hyp: hyp[0], reverse=True)[:num_return] for pool in pools]
    width = max(len(_cut_after_eos(seq)) for hyps in chosen for _, seq in hyps)
    sequences = torch.full((len(pools), num_return, width), PAD_ID, dtype=torch.long, device=device)
    scores = torch.full((len(pools), num_return), float("-inf"), device=device)
    for i, hyps in enumerate(chosen):
        for r, (score, seq) in enumerate(hyps):
            seq = _cut_after_eos(seq)
            sequences[i, r, :len(seq)] = torch.tensor(seq, device=device)
            scores[i, r] = score
    return BeamOutput(sequences, scores)
