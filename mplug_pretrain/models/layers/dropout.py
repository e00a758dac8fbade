"""Dropout with a cheaper keep mask on CPU, and attention-probability dropout outside SDPA on CPU.

``dropout(x, p, training)``: zero each element with probability p, scale the others by 1 / (1 - p) (as
``F.dropout``). On CPU the mask is ``r >= round(p * 2^31)`` for r uniform 32-bit integers in [0, 2^31):
torch's CPU ``bernoulli_`` costs about 5 ns an element, ``random_`` on int32 about 2 (bench/NOTES.md,
"Decoding and the decoder against transformers"); the keep probability is exact to 2^-31. Other devices use
``F.dropout`` (fused there), and so does code being compiled (run.compile: inductor generates the mask).

``attention_with_dropout(q, k, v, bias, p)``: softmax(q k^T / sqrt(d) + bias) with dropout on the probabilities,
times v; q [B, H, T, d], k and v [B, H, S, d], bias broadcastable to [B, H, T, S] -> [B, H, T, d]. On CPU, SDPA
with dropout_p > 0 leaves its fused kernel for a math path (q and k each scaled and k copied contiguous, plus
``bernoulli_``); this computes the same thing with one scaling and the mask above.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_RANDOM_RANGE = 2 ** 31  # int32 random_() draws uniformly from [0, 2^31)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    if not training or p == 0.0:
        return x
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if x.device.type != "cpu" or p == 1.0 or torch.compiler.is_compiling():
        return F.dropout(x, p, True)  # compiled: dynamo cannot trace random_(); inductor fuses its own mask
    keep = torch.empty(x.shape, dtype=torch.int32).random_() >= round(p * _RANDOM_RANGE)
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)


class Dropout(nn.Module):
    """``nn.Dropout`` on ``dropout`` above (no parameters: checkpoints are unchanged)."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                           p: float) -> torch.Tensor:
    scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))
    if bias is not None:
        scores = scores + bias
    return torch.matmul(dropout(scores.softmax(-1), p), v)
