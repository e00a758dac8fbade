"""ITM hard negatives drawn from every rank's batch (``heads.itm_negatives: global``, as BLIP gathers its ITM
candidates; the paper's default, ``rank``, draws them from the rank's own micro-batch: heads/itm.py).

Each rank keeps its own B positives (image_i, text_i). The pool is every rank's rows in rank order (P rows in all):
image and text states (text padded to the longest T of any rank, mask 0 there), ITC features and ids. For local
text i a pool image j ~ softmax(s_t2i[i, :]) + eps, for local image i a pool text j ~ softmax(s_i2t[i, :]) + eps,
zero where pool pair j shares row i's id (without ids: its own pool row), drawn by ``draw_negatives``.
The pool's states are gathered with their gradient (heads/rank_rows.py): a row another rank draws sends its
gradient back to the rank that owns it, so with the same draws the ranks' mean loss and their averaged gradients
(DeepSpeed's all-reduce) equal one process's ITM on the global batch.
Cost: every rank holds the pool's image states [P, N, D] (BLIP's cost too) and fuses 2B images (its own and the
B drawn for its texts) instead of B.

Examples (3B, as rank-local ITM): text rows [text_i; text_i; pool_text[neg(i)]], image rows [image_i;
pool_image[neg(i)]; image_i], labels [1; 0; 0].
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mplug_pretrain.models.heads.itm import HardNegatives, draw_negatives
from mplug_pretrain.models.heads.rank_rows import gather_rows, gather_rows_with_grad
from mplug_pretrain.utils import process_group


@dataclass
class Pool:
    image_states: torch.Tensor  # [P, N, D] (gradient to the owning rank)
    text_states: torch.Tensor  # [P, T', D] (gradient to the owning rank)
    text_mask: torch.Tensor  # [P, T']
    image_feat: torch.Tensor  # [P, E] no gradient
    text_feat: torch.Tensor  # [P, E] no gradient
    ids: torch.Tensor  # [P] the sample ids, or each row's pool position where a batch has none
    offset: int  # this rank's first row in the pool


@dataclass
class ItmExamples:
    images: torch.Tensor  # [2B, N, D]: this rank's images, then the pool images drawn for its texts
    image_rows: torch.Tensor  # [3B] row of ``images`` each text row fuses with
    texts: torch.Tensor  # [3B, T', D]
    text_mask: torch.Tensor  # [3B, T']
    labels: torch.Tensor  # [3B] 1 = matched
    weights: torch.Tensor  # [3B] 0 where a row had no true negative


def gather_pool(image_states: torch.Tensor, text_states: torch.Tensor, text_mask: torch.Tensor,
                image_feat: torch.Tensor, text_feat: torch.Tensor, idx: torch.Tensor | None) -> Pool:
    """Every rank's rows (a collective: every rank calls it). Inputs: this rank's [B, ...]; idx [B] or None."""
    b, t = text_states.shape[:2]
    device = image_states.device
    shapes = gather_rows(torch.tensor([[b, t]], device=device), [1] * process_group.world_size()).tolist()
    sizes, longest = [rows for rows, _ in shapes], max(length for _, length in shapes)  # one host sync
    text_states, text_mask = _pad_text(text_states, text_mask, longest)
    offset = sum(sizes[:process_group.rank()])
    if idx is None:
        idx = torch.arange(offset, offset + b, device=device)
    return Pool(gather_rows_with_grad(image_states, sizes), gather_rows_with_grad(text_states, sizes),
                gather_rows(text_mask, sizes), gather_rows(image_feat.detach(), sizes),
                gather_rows(text_feat.detach(), sizes), gather_rows(idx, sizes), offset)


def pool_negatives(pool: Pool, image_feat: torch.Tensor, text_feat: torch.Tensor,
                   similarities: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   generator: torch.Generator | None = None) -> HardNegatives:
    """Negatives for this rank's B rows as pool rows; ``similarities(a [B, E], b [E, P])`` is ITC's (fp32 / tau)."""
    own = pool.ids[pool.offset:pool.offset + image_feat.shape[0]]  # this rank's ids as the pool holds them
    with torch.no_grad():
        same = own[:, None] == pool.ids[None, :]
        return draw_negatives(similarities(image_feat, pool.text_feat.t()),
                              similarities(text_feat, pool.image_feat.t()), same, generator=generator)


def pool_examples(image_states: torch.Tensor, text_states: torch.Tensor, text_mask: torch.Tensor, pool: Pool,
                  negatives: HardNegatives) -> ItmExamples:
    """The 3B examples of the module docstring from this rank's rows and its draws from the pool."""
    b = image_states.shape[0]
    device = image_states.device
    text_states, text_mask = _pad_text(text_states, text_mask, pool.text_states.shape[1])
    rows = torch.arange(b, device=device)
    labels = torch.zeros(3 * b, dtype=torch.long, device=device)
    labels[:b] = 1
    return ItmExamples(
        images=torch.cat([image_states, pool.image_states[negatives.image_for_text]]),
        image_rows=torch.cat([rows, rows + b, rows]),
        texts=torch.cat([text_states, text_states, pool.text_states[negatives.text_for_image]]),
        text_mask=torch.cat([text_mask, text_mask, pool.text_mask[negatives.text_for_image]]),
        labels=labels,
        weights=torch.cat([torch.ones_like(negatives.text_valid), negatives.text_valid, negatives.image_valid]))


def _pad_text(states: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, D], [B, T] -> [B, length, D], [B, length] (zeros, mask 0: keys no query attends to)."""
    extra = length - states.shape[1]
    if extra <= 0:
        return states, mask
    return F.pad(states, (0, 0, 0, extra)), F.pad(mask, (0, extra))
