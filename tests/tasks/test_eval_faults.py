"""Issue 24, item 12 (evaluation part): `mplug eval caption` needs only what evaluation reads (not the training
shards); without Java, 'coco' metrics fail before any caption is generated with one `mplug:` line, and
`eval.caption_metrics=cider` runs with no Java at all (its CIDEr equal to the Java tokenizer's); `mplug caption`
and `mplug convert` name a missing file or a run folder in one line."""
import json
import os
import shutil

import numpy as np
import pytest

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.data.synthetic.scenes import encode_jpeg, render_scene, sample_scene
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from tests.helpers import call_mplug

pytestmark = pytest.mark.usefixtures("one_thread")

REFS = {7: ["a red circle on the left", "a small red circle"], 9: ["a blue square at the top", "blue square"]}
FAST = ["eval.num_workers=0", "eval.batch_size=2", "caption.generation.beam_size=2",
        "caption.generation.max_length=6", "caption.generation.min_length=2"]


@pytest.fixture(scope="module")
def val_shard(module_mktemp):
    folder = module_mktemp("val")
    with ShardWriter(str(folder), "val", kind="image-text", created_by="test") as writer:
        for i, (image_id, refs) in enumerate(REFS.items()):
            rng = np.random.default_rng([5, i])
            writer.write({"__key__": f"{i:05d}", "jpg": encode_jpeg(render_scene(sample_scene(rng, 64), rng)),
                          "json": {"image_id": image_id, "captions": refs}})
    return str(folder / "val-000000.tar")


@pytest.fixture
def config_with_missing_training_inputs(tmp_path):
    """A fine-tuning config as a user has it on an evaluation machine: the training shards are elsewhere."""
    path = tmp_path / "caption.yaml"
    path.write_text("data:\n  train_shards: /nowhere/train-{000..009}.tar\n"
                    "caption:\n  train_shards: /nowhere/coco-train-{000..099}.tar\n"
                    "vqa:\n  train_shards: /nowhere/vqa-{000..009}.tar\n")
    return str(path)


@pytest.fixture
def no_java(tmp_path, monkeypatch):
    original = os.environ.get("PATH", os.defpath)
    empty = tmp_path / "bin_without_java"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert shutil.which("java") is None
    return original


def _eval_caption(config, model_dir, val_shard, out, *overrides):
    return call_mplug(["eval", "caption", "--config", config, "--checkpoint", model_dir, "--out", str(out),
                       f"eval.shards={val_shard}", *FAST, *overrides])


def test_eval_caption_without_training_shards_and_without_java_with_cider(
        config_with_missing_training_inputs, model_dir, val_shard, tmp_path, no_java, monkeypatch):
    out = tmp_path / "m.json"
    proc = _eval_caption(config_with_missing_training_inputs, model_dir, val_shard, out, "eval.caption_metrics=cider")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["caption_metrics"] == "cider" and "METEOR" not in metrics and metrics["num_images"] == 2
    with open(metrics["predictions"]) as f:
        predictions = {r["image_id"]: r["caption"] for r in json.load(f)}
    assert sorted(predictions) == sorted(REFS)
    monkeypatch.setenv("PATH", no_java)  # the independent check below runs the Java tokenizer
    if shutil.which("java") is None:
        pytest.skip("no Java here to compare the CIDEr with")
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
    tokenized = PTBTokenizer().tokenize({("ref", i): [{"caption": c} for c in REFS[i]] for i in REFS}
                                        | {("res", i): [{"caption": predictions[i]}] for i in REFS})
    expected, _ = Cider().compute_score({i: tokenized[("ref", i)] for i in REFS},
                                        {i: tokenized[("res", i)] for i in REFS})
    assert metrics["CIDEr"] == pytest.approx(expected, abs=1e-12)


def test_eval_caption_coco_metrics_without_java_fail_before_generating(
        config_with_missing_training_inputs, model_dir, val_shard, tmp_path, no_java, monkeypatch):
    from mplug_pretrain.tasks.caption import evaluate as caption_task
    generated = []
    monkeypatch.setattr(caption_task, "generate_captions", lambda *a, **k: generated.append(1) or ({}, {}))
    proc = _eval_caption(config_with_missing_training_inputs, model_dir, val_shard, tmp_path / "m.json")
    assert proc.returncode == 2
    assert proc.stderr.startswith("mplug: config error: eval.caption_metrics:") and "Java" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not generated and not (tmp_path / "m.json").exists()


def test_caption_and_convert_name_a_missing_file_or_a_run_folder_in_one_line(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(model_dir, run_dir / "model")
    cases = {
        ("caption", "--checkpoint", str(run_dir), "x.png"): f"pass {run_dir / 'model'}",
        ("caption", "--checkpoint", str(tmp_path / "nothing"), "x.png"): "no such folder",
        ("caption", "--checkpoint", model_dir, str(tmp_path / "missing.png")): "missing.png",
        ("convert", "expansionnet", "--checkpoint", str(tmp_path / "no.pth"), "--out", str(tmp_path / "o")):
            "no such file",
        ("convert", "expansionnet", "--checkpoint", str(run_dir), "--out", str(tmp_path / "o")): "a folder",
    }
    for args, message in cases.items():
        proc = call_mplug(list(args))
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert proc.stderr.startswith("mplug: ") and message in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
