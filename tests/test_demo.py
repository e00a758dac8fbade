"""The main job, end to end, once (one shared fixture): `mplug demo` pretrains, fine-tunes and
evaluates on the embedded data and must beat its reference levels by the promised margins."""
import json

import pytest

from tests.helpers import read_log, run_mplug

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, demo_shards):
    out = tmp_path_factory.mktemp("demo") / "demo"
    proc = run_mplug(["demo", "--out", str(out)], timeout=1800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    with open(out / "metrics.json") as f:
        return out, json.load(f), proc.stdout


def test_demo_writes_metrics_report_and_plots(demo_run):
    out, metrics, _ = demo_run
    for key in ("retrieval_r1", "retrieval_chance", "caption_cider", "caption_cider_xe", "caption_sample_cider",
                "caption_sample_cider_xe", "vqa_accuracy",
                "vqa_majority_baseline", "video_retrieval_r1", "video_retrieval_chance"):
        assert isinstance(metrics.get(key), (int, float)), key
    report = (out / "report.md").read_text()
    assert "retrieval" in report.lower() and "vqa" in report.lower()
    assert (out / "plots" / "pretrain_losses.png").stat().st_size > 1000


def test_demo_pretraining_lowers_every_loss(demo_run):
    out, _, _ = demo_run
    log = read_log(out / "pretrain")
    window = max(5, len(log) // 10)
    for key in ("loss_itc", "loss_itm", "loss_mlm", "loss_prefixlm"):
        first = sum(r[key] for r in log[:window]) / window
        last = sum(r[key] for r in log[-window:]) / window
        assert last < first, (key, first, last)


def test_demo_pretraining_lowers_the_language_losses(demo_run):
    out, _, _ = demo_run
    log = read_log(out / "pretrain")
    for key in ("loss_mlm", "loss_prefixlm"):  # the total is dominated by ITC (4x), near log(queue) by design
        assert sum(r[key] for r in log[-10:]) / 10 < 0.5 * sum(r[key] for r in log[:10]) / 10, key


def test_demo_retrieval_beats_chance_threefold(demo_run):
    _, metrics, _ = demo_run
    assert metrics["retrieval_r1"] >= 3 * metrics["retrieval_chance"], metrics


def test_demo_vqa_beats_majority_by_ten_points(demo_run):
    _, metrics, _ = demo_run
    assert metrics["vqa_accuracy"] >= metrics["vqa_majority_baseline"] + 10, metrics


def test_demo_scst_raises_the_heldout_mean_cider_of_sampled_captions(demo_run):
    """What SCST maximises (the expected CIDEr-D of sampled captions) rises on images it never trained on."""
    _, metrics, _ = demo_run
    assert metrics["caption_sample_cider"] > metrics["caption_sample_cider_xe"], metrics


def test_demo_scst_raises_heldout_cider_over_xe(demo_run):
    """Issue 7: XE then SCST beats XE alone in held-out beam-search CIDEr-D (same images, same beam)."""
    _, metrics, _ = demo_run
    assert metrics["caption_cider"] > metrics["caption_cider_xe"], metrics


def test_demo_video_retrieval_is_reported_next_to_chance(demo_run):
    _, metrics, stdout = demo_run
    assert 0 <= metrics["video_retrieval_chance"] < 100 and 0 <= metrics["video_retrieval_r1"] <= 100
    assert "video_retrieval_r1" in stdout


def test_readme_library_example_runs_on_the_demo_models(demo_run, tmp_path):
    """The README's 'Use it as a library' example, verbatim, on the folders `mplug demo` really wrote."""
    import os
    import re
    import subprocess
    import sys

    import numpy as np

    from mplug_pretrain.data.synthetic_scenes import render_scene, sample_scene
    from tests.helpers import REPO_ROOT
    from tests.test_library_api import readme_library_example

    out, _, _ = demo_run
    example = readme_library_example()
    (tmp_path / "runs").mkdir()
    os.symlink(out, tmp_path / "runs" / "demo")
    for path in re.findall(r'"(runs/demo/[^"]+)"', example):
        assert (tmp_path / path / "model.safetensors").is_file(), f"the demo wrote no {path}"
    for name in re.findall(r'Image\.open\("([^"]+)"\)', example):
        rng = np.random.default_rng(0)
        render_scene(sample_scene(rng, 64), rng).save(tmp_path / name)
    proc = subprocess.run([sys.executable, "-c", example], check=False, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) >= 3, proc.stdout  # similarity, caption, answer
