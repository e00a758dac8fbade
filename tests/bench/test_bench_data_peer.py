"""`mplug bench data-peer --quick`, `mplug bench dataloader --quick`: ours vs open_clip's get_wds_dataset, before vs
after, on the 640 x 480 photo shards (JSON form, sane rates)."""
import json
import math

import pytest

from mplug_pretrain.bench.data_peer import _import_get_wds_dataset, run
from mplug_pretrain.data.formats.image_decode import decode_image
from tests.data.shard_samples import read_samples


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


def test_quick_rows_are_on_real_size_photos(tmp_path):
    from mplug_pretrain.bench.photo_shards import ensure_photo_shards
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
    from mplug_pretrain.data.tokenizer import load_tokenizer
    result = run(str(tmp_path / "data_peer.json"), quick=True)
    assert result["shards"] == ensure_photo_shards() and result["photo_size"] == "640x480"
    loader = build_pretrain_loader(LoaderSpec.evaluation(result["shards"], 2), load_tokenizer(), image_size=16,
                                   max_text_len=8, augment=False)
    assert next(iter(loader))["image"].shape == (2, 3, 16, 16)
    first = read_samples(result["shards"].replace("{000000..000003}", "000000"))[0]
    assert decode_image(first["jpg"]).size == (640, 480) and first["jpg"][:2] == b"\xff\xd8"  # a JPEG


def test_dataloader_bench_alternates_before_and_after(tmp_path):
    from mplug_pretrain.bench.dataloader import run as run_dataloader
    result = run_dataloader(str(tmp_path / "dataloader.json"), quick=True)
    assert [r["pipeline"] for r in result["rows"]] == ["before", "after"]
    (summary,) = result["summary"]
    assert summary["after_over_before"] == pytest.approx(summary["after_per_worker"] / summary["before_per_worker"])
    assert all(math.isfinite(r["samples_per_s"]) and r["samples"] > 0 for r in result["rows"])
    assert summary["workers"] == 0 and summary["after_over_before_cpu"] == pytest.approx(
        summary["after_per_cpu_s"] / summary["before_per_cpu_s"])
    assert all(0 < r["samples_per_cpu_s"] < 1e6 for r in result["rows"])
