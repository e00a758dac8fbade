"""Answer-list ranking (ALBEF / BLIP / mPLUG ``rank_answer``): VQA with a closed answer list and
zero-shot video QA.

For question b with decoder memory (memory[b], memory_mask[b]) and C candidate answers
a_c = "[CLS] w_1 .. w_n [SEP]" (right padded):
  1. one decoder step on [CLS] gives p(w_1 | [CLS], memory[b]); keep the k candidates whose first token is
     most probable;
  2. full scoring by the chain rule: log p(a_c) = sum_{t=1..n+1} log p(w_t | [CLS] w_<t, memory[b]),
     with w_{n+1} = [SEP] (an answer must also end where it ends);
  3. order the k candidates by that score.
The [CLS] step runs once per question with the decoder's cache (``decoder_api``), and every kept candidate
continues from a copy of it, so the cross-attention keys/values of the memory are projected once per
question, not once per candidate. With k >= C every candidate is scored in full and the first index is the
exact arg-max of the sequence log-probability. Any ``decoder_api`` decoder works (bert | expansion | acf).
"""
from __future__ import annotations

import torch
from torch import nn

from mplug_pretrain.models.decoders.api import BOS_ID, EOS_ID


def check_answer_tokens(answer_ids: torch.Tensor, answer_mask: torch.Tensor) -> None:
    """Candidates must be [C, L] "[CLS] ... [SEP]" rows, right padded, with a matching mask."""
    if answer_ids.ndim != 2 or answer_ids.shape != answer_mask.shape:
        raise ValueError(f"answer_ids {tuple(answer_ids.shape)} and answer_mask {tuple(answer_mask.shape)}: "
                         "expected the same shape [C, L]")
    if answer_ids.shape[0] == 0 or answer_ids.shape[1] < 3:
        raise ValueError(f"answer_ids {tuple(answer_ids.shape)}: need >= 1 candidate of >= 1 token "
                         "between [CLS] and [SEP]")
    lengths = answer_mask.long().sum(1)
    positions = torch.arange(answer_ids.shape[1], device=answer_ids.device)
    if not bool((answer_mask.bool() == (positions[None] < lengths[:, None])).all()):
        raise ValueError("answer_mask: must be right padded (ones, then zeros)")
    if bool((lengths < 3).any()):
        raise ValueError(f"answer {int((lengths < 3).nonzero()[0])}: empty (no token between [CLS] and [SEP])")
    if not bool((answer_ids[:, 0] == BOS_ID).all()):
        raise ValueError(f"answer_ids: every candidate must start with [CLS] ({BOS_ID})")
    if not bool((answer_ids.gather(1, (lengths - 1)[:, None]) == EOS_ID).all()):
        raise ValueError(f"answer_ids: every candidate must end with [SEP] ({EOS_ID}) before its padding")


@torch.no_grad()
def rank_answers(model: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor, answer_ids: torch.Tensor,
                 answer_mask: torch.Tensor, k: int = 128, chunk_size: int = 512) -> torch.Tensor:
    """-> indices LongTensor [B, min(k, C)] into the candidate list, best first; ``[:, 0]`` is the answer.

    model: an MPLUG (its ``decoder`` is used) or a bare decoder; memory [B, M, D], memory_mask [B, M];
    answer_ids / answer_mask [C, L] (``tokenize`` of the answer list). ``chunk_size`` bounds the
    (question, candidate) rows scored at once (their logits are [rows, L - 2, V]).
    """
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    if memory.ndim != 3 or memory_mask.shape != memory.shape[:2]:
        raise ValueError(f"memory {tuple(memory.shape)} / memory_mask {tuple(memory_mask.shape)}: expected "
                         "[B, M, D] and [B, M]")
    check_answer_tokens(answer_ids, answer_mask)
    decoder = getattr(model, "decoder", model)
    device, b = memory.device, memory.shape[0]
    answer_ids, answer_mask = answer_ids.to(device), answer_mask.to(device)
    bos = torch.full((b, 1), BOS_ID, dtype=torch.long, device=device)
    start = decoder(bos, torch.ones_like(bos), memory, memory_mask, use_cache=True)
    first = start.logits[:, -1].float().log_softmax(-1)[:, answer_ids[:, 1]]  # [B, C]
    first_scores, chosen = first.topk(min(k, answer_ids.shape[0]), dim=1)  # [B, K]
    rows = torch.arange(b, device=device).repeat_interleave(chosen.shape[1])
    candidates = chosen.reshape(-1)
    scores = first_scores.reshape(-1).clone()
    for s in range(0, rows.shape[0], chunk_size):
        row, cand = rows[s:s + chunk_size], candidates[s:s + chunk_size]
        ids, mask = answer_ids[cand], answer_mask[cand]
        # continue after [CLS] with w_1 .. w_{L-2} as inputs; they predict w_2 .. w_{L-1}
        out = decoder(ids[:, 1:-1], mask[:, :-1], memory.index_select(0, row), memory_mask.index_select(0, row),
                      past=decoder.reorder_cache(start.past, row))
        rest = out.logits.float().log_softmax(-1).gather(2, ids[:, 2:, None]).squeeze(2)
        scores[s:s + chunk_size] += (rest * mask[:, 2:]).sum(1)
    order = scores.view(b, -1).argsort(dim=1, descending=True)
    return chosen.gather(1, order)
