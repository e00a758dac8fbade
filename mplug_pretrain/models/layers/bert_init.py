"""BERT's weight initialisation (as transformers' ``BertPreTrainedModel._init_weights``): N(0, 0.02) for every
linear and embedding weight, zero biases, unit LayerNorms.

Torch's defaults differ: nn.Embedding draws N(0, 1), so a tied LM head would start with logits of standard
deviation ~sqrt(width) (28 at width 768); their softmax is so peaked that its gradient is mostly denormal floats,
and the LM head's backward matmuls then run ~20x slower on a CPU.
"""
from __future__ import annotations

from torch import nn


def bert_init_(module: nn.Module, std: float = 0.02) -> None:
    """In place, on every ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm`` inside ``module``."""
    for part in module.modules():
        if isinstance(part, (nn.Linear, nn.Embedding)):
            nn.init.normal_(part.weight, std=std)
        if isinstance(part, nn.Linear) and part.bias is not None:
            nn.init.zeros_(part.bias)
        if isinstance(part, nn.LayerNorm):
            nn.init.ones_(part.weight)
            nn.init.zeros_(part.bias)
