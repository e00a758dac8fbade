"""Learning-rate schedule stepped by our own code from the global optimizer step (never handed to
DeepSpeed, see anchors §F): linear warm-up to each group's peak, then cosine to ``min_lr``.

    lr(step) = peak * (step + 1) / warmup                             if step < warmup
             = min_lr + (peak - min_lr) * 0.5 * (1 + cos(pi * p))     p = min(1, (step - warmup) / (total - warmup))

with ``step`` the 0-based optimizer step about to be taken, so the first step already moves (peak / warmup).
The momentum-distillation weight ramps up by the same step count (``distill_alpha``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mplug_pretrain.config import Config


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int, min_lr: float) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return peak
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def apply_lr(optimizer, step: int, warmup_steps: int, total_steps: int, min_lr: float) -> dict[str, float]:
    """Set every group's lr from its ``peak_lr``; returns {group name: lr} for logging."""
    lrs = {}
    for i, group in enumerate(optimizer.param_groups):
        group["lr"] = lr_at(step, group["peak_lr"], warmup_steps, total_steps, min_lr)
        lrs[group.get("name", f"group{i}")] = group["lr"]
    return lrs


def distill_alpha(cfg: Config, step: int) -> float:
    """Momentum-distillation weight, ramped from 0 over optim.alpha_warmup_steps (ALBEF)."""
    alpha = cfg.model.heads.distill_alpha
    if cfg.optim.alpha_warmup_steps > 0:
        alpha *= min(1.0, step / cfg.optim.alpha_warmup_steps)
    return alpha
