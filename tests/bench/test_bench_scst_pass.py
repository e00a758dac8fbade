"""`mplug bench scst-pass --quick`: one-pass vs two-pass SCST steps on the demo shards (JSON form, both
vocabularies, both sides, the same loss for the same draws, the load average recorded)."""
import json
import math
import os

import pytest

from mplug_pretrain.bench.scst_pass import run

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_rows(tmp_path, demo_shards, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the demo config names its shards relative to the repository
    out = tmp_path / "scst_pass.json"
    run(str(out), quick=True)
    result = json.loads(out.read_text())
    assert result["bench"] == "scst-pass" and result["threads"] == 1
    assert len(result["load_average_before"]) == len(result["load_average_after"]) == 3
    rows = result["rows"]
    assert [(r["vocabulary"], r["side"]) for r in rows] == [
        ("bert", "one_pass"), ("bert", "two_pass"), ("demo", "one_pass"), ("demo", "two_pass")]
    with open(os.path.join(REPO_ROOT, "data_shards", "vocab", "vocab.txt")) as f:
        demo_rows = sum(1 for _ in f)
    assert [r["vocab_size"] for r in rows] == [30522, 30522, demo_rows, demo_rows]
    for one, two in (rows[:2], rows[2:]):
        assert one["max_loss_difference"] < 1e-5  # the same seed draws the same captions both ways
        assert one["mean_sample_words"] == two["mean_sample_words"]
        assert one["two_pass_over_one_pass"] == pytest.approx(two["median_s"] / one["median_s"])
    for row in rows:
        assert math.isfinite(row["median_s"]) and 0 < row["min_s"] <= row["median_s"] < 60
