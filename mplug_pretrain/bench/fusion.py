"""Fusion-network forward time (mPLUG Fig. 1 / Fig. 3 protocol: "total forward time of 100 samples").

At base width (768, 12 heads, FFN 3072, 6 fusion layers), text length 30 and 257 / 577 visual tokens,
for the skip-connected network with S = 1, 2, 3, 6 (released-code schedule; S = 1, 2 also with the paper's
Algorithm 1 schedule), all-connected (single stream) and two-stream co-attention. Random weights, eval mode,
torch.no_grad, fp32, on the CPU. seconds_per_100 = median over interleaved rounds of one batch's wall-clock time
x (100 / batch). On a shared machine wall time also counts time other processes take from us (the load
averages are recorded), so full mode also reports gflops_per_sample counted by torch.utils.flop_counter: the
compute each design needs, independent of load.
Rows: variant, visual_tokens, seconds_per_100, speedup_vs_all_connected, [gflops_per_sample,
flop_speedup_vs_all_connected], schedule, connected_layers, batch_size, repeats.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mplug_pretrain.bench.common import write_bench
from mplug_pretrain.models.fusion import (
    AllConnectedFusion,
    SkipConnectedFusion,
    TwoStreamFusion,
    fusion_schedule,
    schedule_pattern,
)
from mplug_pretrain.models.towers.text import BertLayer

WIDTH, HEADS, FFN, LAYERS, TEXT_TOKENS, SAMPLES = 768, 12, 3072, 6, 30, 100
PAPER_CLAIM = ("mPLUG (Fig. 1, §5.3.2): skip-connected fusion is at least 4x faster than connected-attention and "
               "co-attention fusion; S=1 -> S=6 is 5x faster; S=6 is ~30% faster than S=3")


def _variants(quick: bool) -> Iterator[tuple[str, str, nn.Module]]:
    """(name, schedule, module). All variants share one set of random base-width layers (weight values do not
    change the timing): each variant is built on the meta device and then given the shared layers."""
    text_layers = nn.ModuleList(BertLayer(WIDTH, HEADS, FFN, 0.1, cross_attention=True) for _ in range(LAYERS))
    image_layers = nn.ModuleList(BertLayer(WIDTH, HEADS, FFN, 0.1, cross_attention=True) for _ in range(LAYERS))

    def shared(factory: Callable[[], nn.Module]) -> nn.Module:
        with torch.device("meta"):
            module = factory()
        module.layers = text_layers  # a connected layer simply never calls its cross-attention
        if hasattr(module, "image_layers"):
            module.image_layers = image_layers
        return module

    for stride in (1, 2, 3, 6):
        rules = ("code",) if quick or stride > 2 else ("code", "paper")
        for rule in rules:
            name = f"skip_s{stride}" + ("" if rule == "code" else "_paper_rule")
            schedule = schedule_pattern(fusion_schedule(LAYERS, stride, rule))
            yield name, schedule, shared(partial(SkipConnectedFusion, WIDTH, HEADS, FFN, LAYERS, stride, rule, 0.1))
    yield "all_connected", "X" * LAYERS, shared(partial(AllConnectedFusion, WIDTH, HEADS, FFN, LAYERS, 0.1))
    yield "two_stream", "T" * LAYERS, shared(partial(TwoStreamFusion, WIDTH, HEADS, FFN, LAYERS, 0.1))


@torch.no_grad()
def _forward(module: nn.Module, image: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor) -> None:
    module(image, None, text, text_mask)


def _flops_per_sample(forward: Callable[[], None], batch: int) -> float:
    # the math SDPA backend runs attention as matmuls the counter sees (it has no formula for the fused CPU kernel)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        forward()
    return counter.get_total_flops() / batch


def run(out: str, quick: bool = False) -> dict:
    """Time every variant; quick=True (test suite): one sample, 257 visual tokens only, one round, no FLOP count.

    Rounds are interleaved (each round times every variant once), so a change in machine load during the run
    hits all variants alike instead of biasing the ones measured at that moment.
    """
    torch.manual_seed(0)
    batch, rounds, warmup = (1, 1, 0) if quick else (8, 3, 1)
    cases = []
    for name, schedule, module in _variants(quick):
        for visual_tokens in ((257,) if quick else (257, 577)):
            inputs = (torch.randn(batch, visual_tokens, WIDTH), torch.randn(batch, TEXT_TOKENS, WIDTH),
                      torch.ones(batch, TEXT_TOKENS, dtype=torch.long))
            cases.append((name, schedule, visual_tokens, partial(_forward, module.eval(), *inputs)))
    load_before = os.getloadavg()
    times: dict[tuple[str, int], list[float]] = {(c[0], c[2]): [] for c in cases}
    for round_index in range(warmup + rounds):
        for name, _, visual_tokens, forward in cases:
            start = time.perf_counter()
            forward()
            if round_index >= warmup:
                times[(name, visual_tokens)].append(time.perf_counter() - start)
    load_after = os.getloadavg()
    rows = []
    for name, schedule, visual_tokens, forward in cases:
        row = {"variant": name, "visual_tokens": visual_tokens,
               "seconds_per_100": statistics.median(times[(name, visual_tokens)]) * SAMPLES / batch,
               "schedule": schedule, "connected_layers": schedule.count("X"), "batch_size": batch, "repeats": rounds}
        if not quick:
            row["gflops_per_sample"] = _flops_per_sample(forward, batch) / 1e9
        rows.append(row)
    for row in rows:
        reference = next(r for r in rows if r["variant"] == "all_connected" and r["visual_tokens"] == row["visual_tokens"])
        row["speedup_vs_all_connected"] = reference["seconds_per_100"] / row["seconds_per_100"]
        if "gflops_per_sample" in row:
            row["flop_speedup_vs_all_connected"] = reference["gflops_per_sample"] / row["gflops_per_sample"]
    return write_bench("fusion", rows, out, quick=quick, width=WIDTH, heads=HEADS, layers=LAYERS,
                       text_tokens=TEXT_TOKENS, paper_claim=PAPER_CLAIM, load_average_before=load_before,
                       load_average_after=load_after,
                       schedule_legend="C co-attention, X connected, T two-stream co-attention")
