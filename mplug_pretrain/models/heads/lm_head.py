"""BERT language-model prediction head, shared by MLM (on fused text) and the BERT decoder.

logits = LN(GELU(W h + b)) E^T + bias      h [..., D] -> [..., V]
E is the word-embedding matrix [V, D] passed in at call time (weight tying without a shared tensor in the
state dict); an untied head owns its own ``weight``. ``vocab`` (a slice of the vocabulary) gives the logits of
those tokens only: the product with the other rows of E is never computed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LMPredictionHead(nn.Module):
    def __init__(self, width: int, vocab_size: int, tied: bool = True):
        super().__init__()
        self.transform = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width, eps=1e-12)
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        self.weight = None if tied else nn.Parameter(torch.randn(vocab_size, width) * 0.02)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """LN(GELU(W h + b)): [..., D] -> [..., D]."""
        return self.norm(F.gelu(self.transform(hidden)))

    def vocab_weight(self, word_embeddings: torch.Tensor | None) -> torch.Tensor:
        """The [V, D] matrix of the vocabulary projection: its own, or the word embeddings when tied."""
        weight = self.weight if self.weight is not None else word_embeddings
        if weight is None:
            raise ValueError("a tied LMPredictionHead needs the word-embedding matrix")
        return weight

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor | None = None,
                vocab: slice | None = None) -> torch.Tensor:
        return vocab_logits(self.features(hidden), self.vocab_weight(word_embeddings), self.bias, vocab)


def vocab_logits(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 vocab: slice | None = None) -> torch.Tensor:
    """features [..., D], weight [V, D], bias [V] -> logits [..., V], or [..., len(vocab)] for those rows only."""
    if vocab is not None:
        weight, bias = weight[vocab], None if bias is None else bias[vocab]
    return F.linear(features, weight, bias)
