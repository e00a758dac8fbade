"""The fusion benchmark in quick mode (every variant timed, JSON written) and its FLOP count."""
from __future__ import annotations

import json

import pytest

from mplug_pretrain.bench import fusion


def test_quick_fusion_bench_writes_all_rows(tmp_path):
    result = fusion.run(str(tmp_path / "fusion.json"), quick=True)
    with open(tmp_path / "fusion.json") as f:
        assert json.load(f)["rows"] == result["rows"]
    variants = {r["variant"] for r in result["rows"]}
    assert variants == {"skip_s1", "skip_s2", "skip_s3", "skip_s6", "all_connected", "two_stream"}
    assert {r["visual_tokens"] for r in result["rows"]} == {257}
    reference = next(r for r in result["rows"] if r["variant"] == "all_connected")
    for row in result["rows"]:  # the ratio recomputed from the raw timings, not trusted
        assert row["seconds_per_100"] > 0
        assert row["speedup_vs_all_connected"] == pytest.approx(reference["seconds_per_100"] / row["seconds_per_100"])
    schedules = {r["variant"]: r["schedule"] for r in result["rows"]}
    assert schedules["skip_s3"] == "CCCXCC" and schedules["skip_s6"] == "CCCCCC"  # DESIGN: j != 0 and j % S == 0
    assert {r["variant"]: r["connected_layers"] for r in result["rows"]} == {
        name: schedule.count("X") for name, schedule in schedules.items()}
    assert result["machine"]["torch"]


def test_flop_count_matches_the_analytic_count():
    """Skip-connected S = 6 (FFN = 4 D), one sample of T text and M visual tokens: per layer the text runs
    Q/K/V/O (4 T D^2) + cross-attention Q and O (2 T D^2) + FFN (8 T D^2), the image runs only the cross-attention
    K/V projections (2 M D^2); attention scores and mixing cost 2 T^2 D (self) + 2 T M D (cross) MACs."""
    from functools import partial

    import torch

    from mplug_pretrain.models.fusion import SkipConnectedFusion
    t, m, d, layers = 30, 257, 64, 6
    module = SkipConnectedFusion(d, 4, 4 * d, layers, 6, "code", 0.0).eval()
    forward = partial(fusion._forward, module, torch.randn(1, m, d), torch.randn(1, t, d), torch.ones(1, t, dtype=torch.long))
    macs_per_layer = 14 * t * d * d + 2 * m * d * d + 2 * t * t * d + 2 * t * m * d
    assert fusion._flops_per_sample(forward, 1) == 2 * macs_per_layer * layers
