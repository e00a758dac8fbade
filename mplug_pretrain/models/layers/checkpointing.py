"""Activation (gradient) checkpointing of one layer call, shared by the ViT, BERT, fusion and decoder stacks."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def run_layer(layer: Callable[..., Any], *args: Any, enabled: bool, **kwargs: Any) -> Any:
    """``layer(*args, **kwargs)``, recomputed in backward when ``enabled`` and autograd is recording."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(layer, *args, use_reentrant=False, **kwargs)
    return layer(*args, **kwargs)
