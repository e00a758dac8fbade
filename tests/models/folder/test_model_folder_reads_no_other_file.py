"""Issue 37, item 1: a model folder someone sends cannot point the loader at another file. Its config.json names a
crafted TorchScript archive (``torch.jit.load`` of it creates a marker file) as ``vision.checkpoint_path``; every
entry point that reads a model folder ignores that setting (with a warning), the marker stays absent, and the model
holds the folder's own weights. (`mplug export` of such a run: tests/train/test_train_run_faults.py.)"""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.config import Config
from mplug_pretrain.data.synthetic.scenes import encode_jpeg, render_scene, sample_scene
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from tests.helpers import call_mplug
from tests.models.weights.torchscript_payloads import save_trapped_archive

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sent_folder(module_mktemp):
    """(a tiny model folder whose config.json names the trapped archive in every weight-path setting, marker)."""
    from mplug_pretrain.models.presets import build_model
    root = module_mktemp("sent")
    marker = root / "marker"
    archive = root / "ViT-B-16.pt"
    save_trapped_archive(str(archive), str(marker))
    torch.jit.load(str(archive))  # the payload is real
    assert marker.exists()
    marker.unlink()
    torch.manual_seed(0)
    folder = root / "model"
    build_model("tiny").save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["vision"]["checkpoint_path"] = str(archive)
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker


def _same_weights(model, folder):
    saved = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    return all(torch.equal(state[k].float(), v.float()) for k, v in saved.items())


def test_create_model_and_transforms_ignores_the_path(sent_folder, caplog):
    from mplug_pretrain.factory import create_model_and_transforms
    folder, marker = sent_folder
    with caplog.at_level(logging.WARNING):
        model, *_ = create_model_and_transforms(str(folder))
    assert not marker.exists()
    assert "ignored model.vision.checkpoint_path" in caplog.text and str(folder / "config.json") in caplog.text
    assert model.config.vision.checkpoint_path is None and _same_weights(model, folder)


def test_init_from_in_pretraining_and_fine_tuning_ignores_the_path(sent_folder):
    from mplug_pretrain.tasks.caption.model import load_caption_model
    from mplug_pretrain.tasks.finetuning import initial_model
    from mplug_pretrain.tasks.pretrain.train import build_model
    folder, marker = sent_folder
    cfg = Config()
    cfg.init_from = str(folder)
    assert _same_weights(build_model(cfg), folder)
    assert _same_weights(initial_model(cfg, "vqa", None), folder)
    load_caption_model(str(folder), cfg.model)
    assert not marker.exists()


def test_mplug_caption_ignores_the_path(sent_folder, tmp_path):
    folder, marker = sent_folder
    image = tmp_path / "scene.png"
    Image.fromarray(np.full((40, 40, 3), 128, np.uint8)).save(image)
    proc = call_mplug(["caption", "--checkpoint", str(folder), str(image), "--max-length", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists()


def test_mplug_eval_checkpoint_ignores_the_path(sent_folder, tmp_path):
    folder, marker = sent_folder
    with ShardWriter(str(tmp_path), "val", kind="image-text", created_by="test") as writer:
        rng = np.random.default_rng(0)
        writer.write({"__key__": "00000", "jpg": encode_jpeg(render_scene(sample_scene(rng, 64), rng)),
                      "json": {"image_id": 1, "captions": ["a red circle"]}})
    config = tmp_path / "caption.yaml"
    config.write_text("data:\n  train_shards: /nowhere/train-{000..009}.tar\n")
    proc = call_mplug(["eval", "caption", "--config", str(config), "--checkpoint", str(folder), "--out", str(tmp_path / "m.json"),
                       f"eval.shards={tmp_path / 'val-000000.tar'}", "eval.num_workers=0", "eval.batch_size=1",
                       "eval.caption_metrics=cider", "caption.generation.beam_size=1",
                       "caption.generation.max_length=4", "caption.generation.min_length=1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists()
