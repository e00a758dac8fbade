"""Activation (gradient) checkpointing of one layer call, shared by the ViT, BERT, fusion and decoder stacks.

Modes (``model.grad_checkpointing``): False keeps every activation; True ("whole layer") keeps only the
layer's input and recomputes the whole layer in backward; ``"selective"`` keeps the outputs of the matrix
products and of attention (the costly, compute-bound ops) and recomputes only the element-wise work between
them (LayerNorm, GELU, residual adds, dropout masks are replayed from the saved RNG state), so backward
repeats the cheap, memory-bound part of the forward: less memory than no checkpointing, less recompute than
whole-layer checkpointing (torch.utils.checkpoint's selective activation checkpointing, as torchtitan's
"op" policy).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

SELECTIVE = "selective"
MODES = (False, True, SELECTIVE)
_aten = torch.ops.aten
# outputs kept by the selective mode: matrix products and attention (every SDPA kernel a CPU or GPU may pick)
SAVED_OPS = frozenset(op for op in (
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    getattr(_aten, "_scaled_dot_product_fused_attention_overrideable", None) and
    _aten._scaled_dot_product_fused_attention_overrideable.default,
) if op is not None)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The (forward, recompute) context pair of the selective mode: save ``SAVED_OPS`` outputs, recompute the rest."""
    return create_selective_checkpoint_contexts(_save_matmuls)


def run_layer(layer: Callable[..., Any], *args: Any, enabled: bool | str, **kwargs: Any) -> Any:
    """``layer(*args, **kwargs)``, checkpointed in the mode ``enabled`` (module docstring) when autograd records."""
    if enabled and torch.is_grad_enabled():
        if enabled == SELECTIVE:
            return checkpoint(layer, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
        return checkpoint(layer, *args, use_reentrant=False, **kwargs)
    return layer(*args, **kwargs)


