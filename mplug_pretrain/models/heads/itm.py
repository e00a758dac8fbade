"""Image-text matching (ITM) with in-batch hard negatives (ALBEF / mPLUG §3.3).

Hard negatives: for text i an image j ~ w_t2i[i, :], for image i a text j ~ w_i2t[i, :], with
    w[i, j] = softmax(s[i, :])_j + eps,  set to 0 where id_i == id_j (the diagonal included),
s the in-batch ITC similarities (no gradient, computed in fp32). The epsilon keeps every row with an
allowed column non-zero, so ``torch.multinomial`` never sees an all-zero row (bf16 softmax underflow,
all-equal similarities). A row whose every column shares its id (a batch of one image's captions) has no
true negative: it is reported invalid and left out of the loss instead of training on a false negative.

Examples (up to 3B): (image_i, text_i) label 1; (image_neg(i), text_i) label 0; (image_i, text_neg(i)) label 0.
Loss: cross-entropy of ``ImageTextMatchingHead`` = Linear(D, 2) on the fused text [CLS], mean over examples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
    sim = sim_i2t.float()
    w_i2t = (sim.softmax(1) + eps).masked_fill(same, 0)
    w_t2i = (sim.t().softmax(1) + eps).masked_fill(same, 0)
    valid = ~same.all(1)  # `same` is symmetric: the same rows lack candidates in both directions
    w_i2t[~valid] = 1.0  # placeholders so multinomial runs; those rows are dropped by the caller
    w_t2i[~valid] = 1.0
    text_for_image = torch.multinomial(w_i2t, 1, generator=generator).squeeze(1)
    image_for_text = torch.multinomial(w_t2i, 1, generator=generator).squeeze(1)
    return HardNegatives(image_for_text, text_for_image, valid, valid.clone())


class ImageTextMatchingHead(nn.Module):
    """fused text [CLS] [N, D] -> match logits [N, 2] (column 1 = matched)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, 2)

    def forward(self, fused_cls: torch.Tensor) -> torch.Tensor:
        return self.linear(fused_cls)

    def loss(self, fused_cls: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.forward(fused_cls).float(), labels)
