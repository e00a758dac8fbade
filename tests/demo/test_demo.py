"""The main job, end to end, once (one shared fixture): `mplug demo --quick` runs every stage of the demo
(pretraining with all four losses, retrieval, captioning XE + SCST, VQA, video retrieval) on a few dozen steps
each and writes what the full demo writes. The full demo's figures are a recipe's result, reproduced by
`make demo` and stated in the README; each stage's learning is tested on its own (tests/tasks/)."""
import json

import pytest

from tests.helpers import read_log, run_mplug

pytestmark = pytest.mark.slow

FIGURES = {  # metric -> (its reference in metrics.json, the range both lie in)
    "retrieval_r1": ("retrieval_chance", (0, 100)),
    "video_retrieval_r1": ("video_retrieval_chance", (0, 100)),
    "vqa_accuracy": ("vqa_majority_baseline", (0, 100)),
    "caption_cider": ("caption_cider_xe", (0, 10)),
    "caption_sample_cider": ("caption_sample_cider_xe", (0, 10)),
}


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, demo_shards):
    out = tmp_path_factory.mktemp("demo") / "demo"
    proc = run_mplug(["demo", "--quick", "--out", str(out)], timeout=2400)
    assert proc.returncode == 0, proc.stderr[-5000:]
    with open(out / "metrics.json") as f:
        return out, json.load(f), proc.stdout


def test_demo_writes_every_figure_beside_its_reference(demo_run):
    _, metrics, stdout = demo_run
    for key, (reference, (low, high)) in FIGURES.items():
        assert low <= metrics[key] <= high and low <= metrics[reference] <= high, (key, reference, metrics)
        assert f"{key}=" in stdout, key
    assert metrics["retrieval_chance"] == pytest.approx(100 * (3 / 750 + 1 / 250) / 2)  # 250 scenes x 3 captions


def test_demo_writes_report_and_plots(demo_run):
    out, metrics, _ = demo_run
    report = (out / "report.md").read_text()
    for key in FIGURES:
        assert f"{metrics[key]:.2f}" in report, key
    assert (out / "plots" / "pretrain_losses.png").stat().st_size > 1000


def test_demo_pretraining_logs_all_four_losses_and_lowers_the_language_losses(demo_run):
    out, metrics, _ = demo_run
    log = read_log(out / "pretrain")
    assert [r["step"] for r in log] == list(range(1, metrics["pretrain_steps"] + 1))
    for record in log:
        assert all(record[k] == record[k] for k in ("loss_itc", "loss_itm", "loss_mlm", "loss_prefixlm")), record
    for key in ("loss_mlm", "loss_prefixlm"):  # the fastest to fall from scratch; ITC/ITM need more steps
        assert sum(r[key] for r in log[-5:]) / 5 < 0.8 * sum(r[key] for r in log[:5]) / 5, key


def test_demo_fine_tunes_caption_and_vqa_models_into_folders(demo_run):
    out, metrics, _ = demo_run
    assert (out / "caption" / "2_scst" / "model" / "model.safetensors").is_file()
    assert metrics["caption_model_dir"].endswith("2_scst/model")
    assert (out / "vqa" / "model" / "model.safetensors").is_file()


def test_readme_library_example_runs_on_the_demo_models(demo_run, tmp_path):
    """The library example (docs/library.md, repeated in README.md's quick start), verbatim, on the folders
    `mplug demo` really wrote."""
    import os
    import re
    import subprocess
    import sys

    import numpy as np

    from mplug_pretrain.data.synthetic.scenes import render_scene, sample_scene
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


def test_report_shows_held_out_images_with_the_models_own_captions_and_answers(demo_run, demo_shards):
    """The examples in report.md are what the saved captioner / VQA model say about those held-out images,
    recomputed here through the library API from the shards themselves."""
    import io
    import tarfile

    from PIL import Image

    import mplug_pretrain
    out, metrics, _ = demo_run
    report = (out / "report.md").read_text()
    assert (out / "plots" / "examples.png").stat().st_size > 1000

    def first_samples(url, image_ext, count=6):
        images, metas = {}, {}
        with tarfile.open(url) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                if ext == image_ext:
                    images[key] = Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB")
                elif ext == "json":
                    metas[key] = json.load(tar.extractfile(member))
        keys = [k for k in images if k in metas][:count]  # shard order
        return [images[k] for k in keys], [metas[k] for k in keys]

    scenes, _ = first_samples(demo_shards["caption_val"], "jpg")
    captioner, *_ = mplug_pretrain.create_model_and_transforms(metrics["caption_model_dir"])
    for i, caption in enumerate(captioner.caption(scenes)):
        assert f"| ![](plots/examples/caption_{i}.png) | {caption} |" in report
        assert (out / "plots" / "examples" / f"caption_{i}.png").is_file()
    images, metas = first_samples(demo_shards["vqa_val"], "png")
    vqa, *_ = mplug_pretrain.create_model_and_transforms(metrics["vqa_model_dir"])
    for i, (meta, answer) in enumerate(zip(metas, vqa.answer(images, [m["question"] for m in metas]))):
        assert f"| ![](plots/examples/vqa_{i}.png) | {meta['question']} | {answer} |" in report
