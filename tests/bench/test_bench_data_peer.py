"""`mplug bench data-peer --quick`: ours vs open_clip's get_wds_dataset on the demo shards (JSON form, sane rates)."""
import json
import math

import pytest

from mplug_pretrain.bench.data_peer import _import_get_wds_dataset, run


def test_quick_rows(tmp_path, demo_shards):
    out = tmp_path / "data_peer.json"
    run(str(out), quick=True)
    result = json.loads(out.read_text())
    assert result["bench"] == "data_peer" and "open_clip" in result["peer"]
    (row,) = result["rows"]
    assert row["workers"] == 1
    for key in ("ours_samples_per_s", "open_clip_samples_per_s"):
        assert math.isfinite(row[key]) and 1 < row[key] < 1e6
    assert row["ratio"] == pytest.approx(row["ours_samples_per_s"] / row["open_clip_samples_per_s"])


def test_open_clip_pipeline_is_open_clips_own():
    get_wds_dataset = _import_get_wds_dataset()
    assert get_wds_dataset.__module__ == "open_clip_train.data"
