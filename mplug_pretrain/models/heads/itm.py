"""Image-text matching (ITM) with in-batch hard negatives (ALBEF / mPLUG §3.3).

Hard negatives: for text i an image j ~ w_t2i[i, :], for image i a text j ~ w_i2t[i, :], with
    w[i, j] = softmax(s[i, :])_j + eps,  set to 0 where id_i == id_j (the diagonal included),
s the in-batch ITC similarities (no gradient, computed in fp32). The epsilon keeps every row with an
allowed column non-zero, so no row is all-zero (bf16 softmax underflow, all-equal similarities). NaN/inf
similarities (a diverging step, which the training loop then skips) are replaced by finite values first, so
sampling never fails. One draw per row by inverse CDF (``searchsorted`` of a uniform in the cumulative
weights), the distribution ``torch.multinomial`` draws from, without its checks' host syncs.
A row whose every column shares its id (a batch of one image's captions) has no
true negative: it is reported invalid and weighted out of the loss instead of training on a false negative.

Examples (up to 3B): (image_i, text_i) label 1; (image_neg(i), text_i) label 0; (image_i, text_neg(i)) label 0.
Loss: cross-entropy of ``ImageTextMatchingHead`` = Linear(D, 2) on the fused text [CLS], mean over examples
(logits and loss in fp32, an fp32 island inside a bf16 forward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mplug_pretrain.utils.precision import fp32_island


@dataclass
class HardNegatives:
    image_for_text: torch.Tensor  # [B] index of the negative image paired with text i
    text_for_image: torch.Tensor  # [B] index of the negative text paired with image i
    text_valid: torch.Tensor  # [B] bool: text i has a negative image
    image_valid: torch.Tensor  # [B] bool: image i has a negative text


@torch.no_grad()
def sample_hard_negatives(sim_i2t: torch.Tensor, idx: torch.Tensor | None = None, eps: float = 1e-4,
                          generator: torch.Generator | None = None) -> HardNegatives:
    """sim_i2t [B, B] (image rows, text columns); idx [B] ids or None (each pair its own id)."""
    b = sim_i2t.shape[0]
    if sim_i2t.shape != (b, b):
        raise ValueError(f"sim_i2t must be square [B, B], got {tuple(sim_i2t.shape)}")
    if idx is None:
        same = torch.eye(b, dtype=torch.bool, device=sim_i2t.device)
    else:
        same = idx[:, None] == idx[None, :]
    return draw_negatives(sim_i2t, sim_i2t.t(), same, eps, generator)


@torch.no_grad()
def draw_negatives(sim_i2t: torch.Tensor, sim_t2i: torch.Tensor, same: torch.Tensor, eps: float = 1e-4,
                   generator: torch.Generator | None = None) -> HardNegatives:
    """The draw of the module docstring from a pool of P candidates: sim_i2t [B, P] (image i against pool text j),
    sim_t2i [B, P] (text i against pool image j), same [B, P] bool (pool pair j shares row i's id: no negative).
    Indices are pool rows."""
    with fp32_island(sim_i2t.device):
        w_i2t = (_finite(sim_i2t).softmax(1) + eps).masked_fill(same, 0)
        w_t2i = (_finite(sim_t2i).softmax(1) + eps).masked_fill(same, 0)
        valid = ~same.all(1)  # a pool pair carries one id for its image and its text: one mask for both sides
        w_i2t = torch.where(valid[:, None], w_i2t, 1.0)  # placeholders; those rows are weighted out by the caller
        w_t2i = torch.where(valid[:, None], w_t2i, 1.0)
        text_for_image = _draw_one(w_i2t, generator)
        image_for_text = _draw_one(w_t2i, generator)
    return HardNegatives(image_for_text, text_for_image, valid, valid.clone())


def _finite(sim: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(sim.float(), nan=0.0, posinf=1e4, neginf=-1e4)


def _draw_one(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One column per row of non-negative ``weights`` [B, N] (every row with a positive entry), with
    probability proportional to its weight: the first column whose cumulative weight exceeds u * total."""
    cumulative = weights.cumsum(1)
    u = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device, dtype=weights.dtype)
    column = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True).squeeze(1)
    return column.clamp(max=weights.shape[1] - 1)  # u * total rounding onto the last boundary


class ImageTextMatchingHead(nn.Module):
    """fused text [CLS] [N, D] -> match logits [N, 2] (column 1 = matched)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, 2)

    def forward(self, fused_cls: torch.Tensor) -> torch.Tensor:
        with fp32_island(fused_cls.device):
            return F.linear(fused_cls.float(), self.linear.weight.float(), self.linear.bias.float())

    def loss(self, fused_cls: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy over examples; ``weights`` [N] (0/1) leave examples out without changing shapes."""
        with fp32_island(fused_cls.device):
            if weights is None:
                return F.cross_entropy(self(fused_cls), labels)
            losses = F.cross_entropy(self(fused_cls), labels, reduction="none")
            weights = weights.float()
            return (losses * weights).sum() / weights.sum().clamp(min=1.0)
