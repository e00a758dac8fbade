"""Momentum (EMA) update of momentum encoders: theta_m <- m * theta_m + (1 - m) * theta (ALBEF / MoCo).

One ``torch._foreach_mul_`` + one ``torch._foreach_add_`` over all parameters of a module pair instead of
two kernels per parameter: on a GPU that is a handful of fused multi-tensor launches for the whole encoder.
Elementwise it is the same two operations in the same order as the per-parameter formula, so the result
is bit-identical to ``p_m.mul_(m).add_(p, alpha=1 - m)``.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def ema_update_(momentum_params: list[torch.Tensor], online_params: list[torch.Tensor], m: float) -> None:
    """In place on ``momentum_params`` (same shapes as ``online_params``, any dtype)."""
    if len(momentum_params) != len(online_params):
        raise ValueError(f"momentum update: {len(momentum_params)} momentum parameters for "
                         f"{len(online_params)} online parameters")
    if not momentum_params:
        return
    targets = [p.data for p in momentum_params]
    sources = [p.detach().to(t.dtype) for p, t in zip(online_params, targets)]
    torch._foreach_mul_(targets, m)
    torch._foreach_add_(targets, sources, alpha=1.0 - m)
