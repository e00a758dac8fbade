"""Held-out validation while pretraining (tasks/pretrain/validation.py, train/loop.py ``_maybe_validate``): a tiny
run with data.val_shards logs the held-out losses and ITC recall every run.eval_every_steps and at the end, to
log.jsonl and TensorBoard, keeps best/ by run.best_metric, and its last recall equals what `mplug eval retrieval`
(ITC only, an independent pipeline) measures on the final model over the same held-out images."""
import json
import os

import pytest

from tests.helpers import REPO_ROOT, read_log, run_mplug, tiny_pretrain_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def validated_run(module_mktemp, demo_shards):
    from mplug_pretrain.data.writers.synthetic import write_synthetic_image_shards
    root = module_mktemp("val")
    entry = write_synthetic_image_shards(str(root / "held_out"), num_scenes=24, captions_per_scene=1, layout="image",
                                         seed=11, name="val")
    val = os.path.join(str(root / "held_out"), entry["shards"][0]["file"])
    args = tiny_pretrain_args(root, demo_shards, "run", 6, extra=(
        f"data.val_shards={val}", "run.eval_every_steps=2", "run.tensorboard=true", "data.max_text_len=30",
        "run.log_every=1"))
    proc = run_mplug(["pretrain", *args], env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run", val, proc


def test_validation_is_logged_at_the_interval_and_at_the_end(validated_run):
    run_dir, _, proc = validated_run
    records = [r for r in read_log(run_dir) if "val_itc_r1" in r]
    assert [r["step"] for r in records] == [2, 4, 6]
    for r in records:
        assert r["val_samples"] == 24
        assert r["val_time_s"] > 0
        for key in ("val_loss", "val_loss_itc", "val_loss_itm", "val_loss_mlm", "val_loss_prefixlm"):
            assert r[key] > 0 and r[key] == r[key]
        assert 0 <= r["val_itc_txt_r1"] <= r["val_itc_txt_r5"] <= 100
        assert r["val_itc_r1"] == pytest.approx((r["val_itc_txt_r1"] + r["val_itc_img_r1"]) / 2)
    assert "[val] step 6" in proc.stdout + proc.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("val/itc_r1")]
    assert steps == [2, 4, 6]


def test_best_holds_the_best_validation(validated_run):
    run_dir, _, _ = validated_run
    records = [r for r in read_log(run_dir) if "val_itc_r1" in r]
    best = max(records, key=lambda r: r["val_itc_r1"])  # the first of equal values stays best
    with open(run_dir / "best" / "val_metrics.json") as f:
        kept = json.load(f)
    assert kept["step"] == best["step"] and kept["val_itc_r1"] == best["val_itc_r1"]
    assert (run_dir / "best" / "model.safetensors").is_file() and (run_dir / "best" / "config.json").is_file()


def test_last_recall_equals_mplug_eval_retrieval_on_the_final_model(validated_run, tmp_path):
    run_dir, val, _ = validated_run
    last = [r for r in read_log(run_dir) if "val_itc_r1" in r][-1]
    out = tmp_path / "metrics.json"
    config = os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml")
    proc = run_mplug(["eval", "retrieval", "--config", config, "--checkpoint", str(run_dir / "model"), "--out", str(out),
                      f"eval.shards={val}", "eval.rerank_score=itc", "eval.max_text_len=30", "eval.num_workers=0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        metrics = json.load(f)
    assert metrics["num_images"] == 24
    for ours, theirs in (("val_itc_txt_r1", "txt_r1"), ("val_itc_img_r1", "img_r1"), ("val_itc_txt_r5", "txt_r5"),
                         ("val_itc_img_r5", "img_r5")):
        assert last[ours] == pytest.approx(metrics[theirs], abs=1e-6), ours
