"""Where one training step's time goes: torch.profiler's ops (CPU) or kernels (CUDA) in five buckets.

    matmul       aten::mm / addmm / bmm / baddbmm / linear / matmul; GPU kernels named gemm, cutlass, xmma,
                 sm80_ / sm90_ (cuBLAS), wgmma
    attention    scaled_dot_product*, flash, fmha, cudnn / efficient attention (and whatever runs inside them)
    optimizer    what runs inside the optimizer step (torch's ``Optimizer.step`` range, DeepSpeed's step),
                 multi_tensor / foreach / adam kernels
    elementwise  everything else the device runs (element-wise ops, reductions, copies and casts)
    idle         wall time - busy: on a GPU the time no kernel runs (launch gaps, host syncs, Python);
                 on the CPU the time outside aten ops (Python, DeepSpeed's bookkeeping)

An op counts by the innermost range that names a bucket, outer ranges first: a copy inside the optimizer step
is optimizer time, a bmm inside SDPA's math path attention time. CPU times are self times (each op's own,
its children apart), so the buckets add up to at most the wall time; GPU times are kernel durations.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable

BUCKETS = ("matmul", "attention", "elementwise", "optimizer", "idle")
_OPTIMIZER = re.compile(r"optimizer\.step|adamw?\b|adam_|multi_tensor|_foreach_|fused_adam|deepspeedzero.*step"
                        r"|zero_optimization.*step", re.IGNORECASE)
_ATTENTION = re.compile(r"scaled_dot_product|flash|fmha|cudnn.*attention|efficient_attention|attention_with_dropout",
                        re.IGNORECASE)
_MATMUL = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|linear|matmul|_addmm_activation)$|gemm|cutlass|xmma"
                     r"|^sm\d\d_|wgmma|cublas", re.IGNORECASE)


def bucket_of(name: str, enclosing: tuple[str, ...] = ()) -> str:
    """The bucket of an op or kernel ``name`` run inside the ranges ``enclosing`` (outermost first)."""
    names = (*enclosing, name)
    if any(_OPTIMIZER.search(n) for n in names):
        return "optimizer"
    if any(_ATTENTION.search(n) for n in names):
        return "attention"
    if any(_MATMUL.search(n) for n in names):
        return "matmul"
    return "elementwise"


def _enclosing(event) -> tuple[str, ...]:
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return tuple(reversed(names))


def buckets_from_events(events, wall_seconds: float, device: str) -> dict:
    """{bucket: seconds} of ``events`` (profiler FunctionEvents) over a step of ``wall_seconds``.
    device "cpu": CPU self times of the ops; "cuda": the durations of the kernels each op launched."""
    seconds = dict.fromkeys(BUCKETS, 0.0)
    for event in events:
        if device == "cuda":
            for kernel in getattr(event, "kernels", ()):
                seconds[bucket_of(kernel.name, (*_enclosing(event), event.name))] += kernel.duration / 1e6
        elif str(getattr(event, "device_type", "CPU")).endswith("CPU") and (
                event.name.startswith("aten::") or _OPTIMIZER.search(event.name)):
            seconds[bucket_of(event.name, _enclosing(event))] += event.self_cpu_time_total / 1e6
    busy = sum(seconds.values())
    seconds["idle"] = max(wall_seconds - busy, 0.0)
    return seconds


def profile_step(step: Callable[[], None], device: str, steps: int = 1) -> dict:
    """Run ``step`` ``steps`` times under torch.profiler -> {"wall_seconds", "<bucket>_seconds",
    "<bucket>_share"} per step (shares of the wall time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    seconds = buckets_from_events(prof.events(), wall * steps, device)
    row = {"wall_seconds": wall}
    for name in BUCKETS:
        row[f"{name}_seconds"] = seconds[name] / steps
        row[f"{name}_share"] = seconds[name] / steps / wall if wall > 0 else 0.0
    return row
