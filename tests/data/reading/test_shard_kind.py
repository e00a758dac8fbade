"""Shards of another kind than a command reads are refused before anything is trained or scored (issue 36, items 2
and 5): pretraining on VQA shards exited 0 with every loss 0 and wrote a model; `eval vqa` on caption shards, `eval
caption` on VQA shards and `eval retrieval` on video shards ended in tracebacks. The manifest records each set's
kind; without one, a run whose first batches decode nothing for one reason stops, and a run that decoded no sample
never exits 0."""
import os
import re

import numpy as np
import pytest

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.data.formats.manifest import MANIFEST_NAME
from mplug_pretrain.data.synthetic.scenes import encode_jpeg, render_scene, sample_scene
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from tests.helpers import REPO_ROOT, call_mplug, run_mplug

pytestmark = pytest.mark.usefixtures("one_thread")


def _image(i: int) -> bytes:
    rng = np.random.default_rng([9, i])
    return encode_jpeg(render_scene(sample_scene(rng, 48), rng))


def write_shards(folder, kind: str, n: int = 8) -> str:
    """n samples of ``kind`` as its writer stores them -> the shard path."""
    with ShardWriter(str(folder), kind, kind=kind, created_by="test") as writer:
        for i in range(n):
            if kind == "vqa":
                sample = {"jpg": _image(i), "json": {"image_id": i, "question_id": 100 + i,
                                                     "question": "what colour is it?", "answers": ["red"] * 3}}
            elif kind == "video":
                sample = {"mp4": b"not decoded here", "json": {"video_id": f"v{i}", "captions": ["a clip"]}}
            else:
                sample = {"jpg": _image(i), "txt": "a red circle", "json": {"image_id": i, "captions": ["a red circle"]}}
            writer.write({"__key__": f"{i:05d}", **sample})
    return str(folder / f"{kind}-000000.tar")


def _one_line(proc, code=3):
    assert proc.returncode == code, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mplug:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("task, config, field, kind, wanted", [
    ("vqa", "vqa_demo", "vqa.val_shards", "image-text", "'vqa'"),
    ("caption", "caption_demo", "caption.val_shards", "vqa", "'image-text'"),
    ("retrieval", "retrieval_coco", "eval.annotations=null eval.image_root=null eval.shards", "video",
     "'image-text'")])
def test_eval_refuses_shards_of_another_kind(tmp_path, model_dir, task, config, field, kind, wanted):
    shard = write_shards(tmp_path, kind)
    proc = call_mplug(["eval", task, "--config", os.path.join(REPO_ROOT, "configs", f"{config}.yaml"),
                       "--checkpoint", model_dir, "--out", tmp_path / "m.json", *f"{field}={shard}".split(),
                       "eval.num_workers=0"])
    line = _one_line(proc)
    assert line == (f"mplug: data error: {shard}: {tmp_path / MANIFEST_NAME} lists it as {kind!r} shards; this "
                    f"command reads {wanted} shards (see `mplug make-shards --help`)")
    assert not (tmp_path / "m.json").exists()


def _pretrain(tmp_path, shards, workers=2):
    return run_mplug(["pretrain", "--config", os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml"),
                      f"data.train_shards={shards}", "data.batch_size=2", f"data.num_workers={workers}",
                      "optim.max_steps=3", "optim.warmup_steps=1", f"run.output_dir={tmp_path}", "run.name=wrong",
                      "run.tensorboard=false", "model.heads.queue_size=8"], timeout=300)


@pytest.mark.slow
def test_pretraining_refuses_vqa_shards_by_their_manifest(tmp_path):
    shard = write_shards(tmp_path / "vqa", "vqa")
    line = _one_line(_pretrain(tmp_path, shard))
    assert line.startswith(f"mplug: data error: {shard}: ") and "lists it as 'vqa' shards" in line
    assert not (tmp_path / "wrong" / "model").exists()


@pytest.mark.slow
def test_pretraining_without_a_manifest_stops_when_the_first_batches_decode_nothing(tmp_path):
    shard = write_shards(tmp_path / "vqa", "vqa")
    os.remove(tmp_path / "vqa" / MANIFEST_NAME)  # copied without it: only the samples tell
    line = _one_line(_pretrain(tmp_path, shard))
    assert re.fullmatch(rf"mplug: data error: {re.escape(shard)}: the first 2 batch\(es\) of epoch 0 decoded no "
                        r"sample, (\d+) skipped \(missing_caption=\1\): shards of another kind than pretrain reads\?",
                        line), line
    assert not (tmp_path / "wrong" / "model").exists()


@pytest.mark.slow
def test_a_run_that_decoded_no_sample_does_not_exit_0(tmp_path):
    """Two skip reasons (no verdict from the first batches), yet not one usable sample in the whole run."""
    with ShardWriter(str(tmp_path / "bad"), "bad", kind="image-text", created_by="test") as writer:
        for i in range(8):
            sample = {"jpg": b"\xff\xd8 not a jpeg", "txt": "a caption"} if i % 2 else {"jpg": _image(i)}
            writer.write({"__key__": f"{i:05d}", **sample})
    shard = str(tmp_path / "bad" / "bad-000000.tar")
    line = _one_line(_pretrain(tmp_path, shard, workers=0))
    found = re.fullmatch(rf"mplug: data error: {re.escape(shard)}: the whole run decoded no sample, (\d+) skipped "
                         r"\(corrupt_image=(\d+), missing_caption=\2\): shards of another kind than pretrain reads\?",
                         line)
    assert found and int(found[1]) == 2 * int(found[2]) > 0, line
    assert not (tmp_path / "wrong" / "model").exists()
