"""`mplug bench train-step --quick`: 2 real DeepSpeed ranks (gloo), ZeRO 0 and 3. The per-rank state bytes are
checked against the byte count of the model itself (built here, independently of the bench): ZeRO-0 holds
4 bytes x parameters, 4 x trainable parameters of gradients and 8 x trainable of Adam moments; ZeRO-3 over 2
ranks holds the fp32 master partition + Adam moments for half of the trainable parameters (12 x T / 2)."""
import json
import math

import pytest

from mplug_pretrain.bench.train_step import run
from mplug_pretrain.models.presets import build_model

pytestmark = pytest.mark.slow  # two torchrun ranks with DeepSpeed: ~40-60 s on the shared 2-core machine


@pytest.fixture(scope="module")
def result(module_mktemp):
    out = module_mktemp("bench") / "train_step.json"
    run(str(out), quick=True)
    with open(out) as f:
        return json.load(f)


def test_json_form_and_sane_rows(result):
    assert result["bench"] == "train_step" and result["machine"]["cpu_count"] >= 1
    assert [(r["ranks"], r["zero_stage"]) for r in result["rows"]] == [(2, 0), (2, 3)]
    for row in result["rows"]:
        assert 0 < row["step_seconds"] < 600 and math.isfinite(row["samples_per_s"])
        assert row["samples_per_s"] == pytest.approx(row["batch_per_rank"] * row["ranks"] / row["step_seconds"])
        assert 50 < row["peak_rss_mb"] < 64_000
        parts = sum(row[f"state_{k}_bytes"] for k in ("parameters", "gradients", "optimizer", "other"))
        assert parts == row["state_total_bytes"]
        assert row["mfu"] == pytest.approx(row["flops_per_sample"] * row["batch_per_rank"] / row["step_seconds"]
                                           / row["matmul_peak_flops"])
        assert 0 < row["mfu"] < 1.5 and 1e8 < row["matmul_peak_flops"] < 1e13


def test_state_bytes_match_the_model(result):
    model = build_model("tiny")
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    zero0, zero3 = result["rows"]
    assert zero0["parameters"] == n
    assert zero0["state_parameters_bytes"] == 4 * n
    assert zero0["state_gradients_bytes"] == 4 * trainable
    assert zero0["state_optimizer_bytes"] == 8 * trainable + 4 * tensors  # exp_avg, exp_avg_sq, step
    assert zero3["state_optimizer_bytes"] == pytest.approx(12 * trainable / 2, rel=0.02)
    assert zero3["state_total_bytes"] < zero0["state_total_bytes"]
    assert zero0["zero_paper_mixed_precision_bytes"] == 16 * trainable
    assert zero3["zero_paper_mixed_precision_bytes"] == 16 * trainable // 2
    assert zero3["state_total_vs_zero0"] == pytest.approx(zero3["state_total_bytes"] / zero0["state_total_bytes"])
