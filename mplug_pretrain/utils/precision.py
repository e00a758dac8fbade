"""Precision helpers shared by training and evaluation.

``autocast_context``: the precision a forward pass computes in *outside* a training engine (evaluation, the
feature cache): under "bf16", torch's bf16 autocast on the device; under "fp32", nothing. Training never
wraps the DeepSpeed engine in it: the engine runs its forward under its own ``torch_autocast``
(docs/precision.md; DeepSpeed silently disables an autocast entered outside it).

``fp32_island``: a region that computes in fp32 even inside an autocast forward (losses, ITC/ITM logits,
hard-negative similarities). ``FP32LayerNorm`` / ``use_fp32_layer_norms``: LayerNorm computed and returned in
fp32 on every device (CUDA autocast does so; CPU autocast runs layer_norm in bf16 for bf16 input).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def autocast_context(precision: str, device: torch.device | str):
    """A context manager: bf16 autocast on ``device``'s type for ``precision == "bf16"``, else a no-op."""
    if precision == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fp32_island(device: torch.device | str):
    """Autocast off on ``device``'s type: inputs cast with ``.float()`` inside compute in fp32."""
    return torch.autocast(device_type=torch.device(device).type, enabled=False)


class FP32LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose statistics and output are fp32 whatever the input dtype and autocast state
    (same parameters and state dict keys; the next matmul casts back to bf16 under autocast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fp32_island(x.device):
            weight = None if self.weight is None else self.weight.float()
            bias = None if self.bias is None else self.bias.float()
            return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)


def use_fp32_layer_norms(model: nn.Module) -> int:
    """Make every plain ``nn.LayerNorm`` of ``model`` an ``FP32LayerNorm`` in place (its class only: parameters,
    hooks and state dict are untouched). -> how many were changed."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.LayerNorm:
            module.__class__ = FP32LayerNorm
            changed += 1
    return changed
