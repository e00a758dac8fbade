"""`mplug bench attention-peer --quick`: ours vs transformers BERT, forward + backward (JSON form, sane times)."""
import json
import math

import pytest

from mplug_pretrain.bench.attention_peer import run


def test_quick_rows(tmp_path):
    out = tmp_path / "attention_peer.json"
    run(str(out), quick=True)
    result = json.loads(out.read_text())
    assert result["bench"] == "attention_peer"
    assert [r["module"] for r in result["rows"]] == ["text_encoder", "bert_decoder"]
    for row in result["rows"]:
        for key in ("ours_seconds", "transformers_seconds"):
            assert math.isfinite(row[key]) and 0 < row[key] < 120
        assert row["ratio"] == pytest.approx(row["transformers_seconds"] / row["ours_seconds"])
        assert row["ours_min_seconds"] <= row["ours_seconds"]
        assert row["ratio_of_min"] == pytest.approx(row["transformers_min_seconds"] / row["ours_min_seconds"])
        assert row["ratio_per_round_median"] == pytest.approx(row["ratio"])  # one round: its ratio is the ratio
        assert row["transformers_attn_implementation"] == "sdpa"
