"""train/schedule.py against the warm-up + cosine schedule written out independently: optimizer step n
(1-based; the loop passes the 0-based global step s = n - 1) has

    lr = peak * n / W                                                    n <= W
    lr = min_lr + (peak - min_lr) / 2 * (1 + cos(pi * (n - 1 - W) / (T - W)))   W < n, clamped at n - 1 = T
"""
import itertools
import math

import pytest
import torch

from mplug_pretrain.train.schedule import apply_lr, lr_at


def reference_lr(n: int, peak: float, warmup: int, total: int, min_lr: float) -> float:
    if n <= warmup:
        return peak * n / warmup
    if total <= warmup:
        return peak
    done = min(n - 1 - warmup, total - warmup)
    return min_lr + (peak - min_lr) * (1 + math.cos(math.pi * done / (total - warmup))) / 2


@pytest.mark.parametrize("peak, warmup, total, min_lr", [(3e-4, 5, 20, 1e-5), (1e-3, 0, 10, 0.0), (2e-4, 4, 4, 1e-6),
                                                         (5e-5, 1, 100, 5e-6)])
def test_lr_at_equals_the_reference_schedule(peak, warmup, total, min_lr):
    for n in range(1, total + 3):  # past the end too: it stays at min_lr
        assert lr_at(n - 1, peak, warmup, total, min_lr) == pytest.approx(reference_lr(n, peak, warmup, total, min_lr),
                                                                          rel=1e-12, abs=1e-15), n


def test_landmarks_of_the_schedule():
    peak, warmup, total, min_lr = 1e-3, 10, 110, 1e-5
    assert lr_at(0, peak, warmup, total, min_lr) == pytest.approx(peak / warmup)  # the first step already moves
    assert lr_at(warmup - 1, peak, warmup, total, min_lr) == pytest.approx(peak)  # the end of warm-up is the peak
    assert lr_at(warmup + 50, peak, warmup, total, min_lr) == pytest.approx((peak + min_lr) / 2)  # cosine midpoint
    assert lr_at(total, peak, warmup, total, min_lr) == pytest.approx(min_lr)
    lrs = [lr_at(s, peak, warmup, total, min_lr) for s in range(total + 1)]
    assert all(a <= b for a, b in itertools.pairwise(lrs[:warmup]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[warmup:]))


def test_apply_lr_sets_every_group_from_its_own_peak():
    vision, rest = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [vision], "lr": 0.0, "peak_lr": 1e-4, "name": "vision_decay"},
                                   {"params": [rest], "lr": 0.0, "peak_lr": 5e-4, "name": "rest_decay"},
                                   {"params": [], "lr": 0.0, "peak_lr": 2e-4}])
    for step in (0, 2, 7, 30):
        got = apply_lr(optimizer, step, warmup_steps=3, total_steps=30, min_lr=1e-6)
        expected = {name: reference_lr(step + 1, peak, 3, 30, 1e-6)
                    for name, peak in (("vision_decay", 1e-4), ("rest_decay", 5e-4), ("group2", 2e-4))}
        assert got == pytest.approx(expected, rel=1e-12)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(list(expected.values()), rel=1e-12)
