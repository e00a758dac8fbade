"""Hugging Face Hub (issue 26): `MPLUG.from_pretrained("org/name")` from huggingface_hub's cache, offline (the
cache laid out by huggingface_hub's own cache functions: blobs, snapshot pointers, refs/main), `push_to_hub`
up to the upload call (no network: a self-contained folder is required first), and the README.md model card
written into every model folder."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.folder.hub import REQUIRED_FILES, push_to_hub
from mplug_pretrain.models.folder.preprocessing import write_inference_files
from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.presets import build_model

huggingface_hub = pytest.importorskip("huggingface_hub")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model_folder(folder: str, repo_id: str, cache_dir: str) -> str:
    """Put ``folder``'s files into a Hub cache the way a download does: each file a blob named by its hash, a
    pointer to it in snapshots/<commit>/, refs/main naming the commit (huggingface_hub.file_download's helpers)."""
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        _get_pointer_path,
        repo_folder_name,
    )
    storage = os.path.join(cache_dir, repo_folder_name(repo_id=repo_id, repo_type="model"))
    os.makedirs(os.path.join(storage, "blobs"), exist_ok=True)
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            blob = os.path.join(storage, "blobs", hashlib.sha256(f.read()).hexdigest())
        shutil.copyfile(os.path.join(folder, name), blob)
        pointer = _get_pointer_path(storage, COMMIT, name)
        os.makedirs(os.path.dirname(pointer), exist_ok=True)
        _create_symlink(blob, pointer, new_blob=True)
    _cache_commit_hash_for_specific_revision(storage, "main", COMMIT)
    return storage


@pytest.fixture(scope="module")
def complete_folder(module_mktemp):
    folder = module_mktemp("hub") / "model"
    torch.manual_seed(0)
    model = build_model("tiny")
    model.save_pretrained(str(folder))
    write_inference_files(str(folder), None, 30)
    return folder, model


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_loads_from_the_cache_offline(complete_folder, offline_cache):
    folder, model = complete_folder
    cache_model_folder(str(folder), "someorg/mplug-tiny", str(offline_cache))
    [repo] = huggingface_hub.scan_cache_dir(str(offline_cache)).repos  # the library reads the layout back
    assert repo.repo_id == "someorg/mplug-tiny" and {f.file_name for f in next(iter(repo.revisions)).files} == \
        set(os.listdir(folder))
    loaded = MPLUG.from_pretrained("someorg/mplug-tiny")
    assert loaded.config == model.config
    expected = model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(ConfigError, match="someorg/absent: not a local folder, and not in the Hugging Face cache"):
        MPLUG.from_pretrained("someorg/absent")


def test_every_model_folder_has_a_model_card(complete_folder):
    folder, _model = complete_folder
    card = (folder / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "mplug_pretrain" and "image-to-text" in front["tags"]
    assert "preset `tiny`" in card and "No run folder beside this model" in card
    values = sum(t.numel() for t in load_file(str(folder / "model.safetensors")).values())
    assert f"{values:,} stored values" in card


def test_a_runs_card_has_its_training_and_metrics(tmp_path):
    run_dir = tmp_path / "caption_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({
        "run": {"name": "caption_run"}, "init_from": "runs/pretrain_base/model",
        "data": {"train_shards": None, "batch_size": 32}, "caption": {"train_shards": "coco/train-{0..9}.tar"},
        "optim": {"max_steps": 500, "lr_rest": 1e-5, "lr_vision": 2e-6, "warmup_steps": 50},
        "distributed": {"precision": "bf16", "zero_stage": 2}}))
    (run_dir / "metrics.json").write_text(json.dumps({"CIDEr": 1.234, "BLEU_4": 0.345, "checkpoint": "x"}))
    torch.manual_seed(0)
    build_model("tiny").save_pretrained(str(run_dir / "model"))
    card = (run_dir / "model" / "README.md").read_text()
    assert "# caption_run" in card and "initialised from: `runs/pretrain_base/model`" in card
    assert "training shards: `coco/train-{0..9}.tar`" in card and "steps: 500" in card
    assert "| CIDEr | 1.234 |" in card and "| BLEU_4 | 0.345 |" in card and "checkpoint |" not in card


def test_push_to_hub_refuses_an_incomplete_folder_and_reaches_the_upload_call(complete_folder, tmp_path):
    bare = tmp_path / "bare"
    build_model("tiny").save_pretrained(str(bare))  # weights only: no tokenizer, no preprocessing.json
    with pytest.raises(ConfigError, match="not self-contained, missing preprocessing.json, vocab.txt"):
        push_to_hub(str(bare), "someorg/mplug-tiny")
    folder, _ = complete_folder
    calls = []

    class RecordingApi:  # huggingface_hub.HfApi's two calls, recorded instead of sent (no network here)
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, folder_path, repo_id, **kwargs):
            calls.append(("upload_folder", repo_id, sorted(os.listdir(folder_path))))
            return huggingface_hub.CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/{COMMIT}",
                                              commit_message="", commit_description="", oid=COMMIT)

    url = push_to_hub(str(folder), "someorg/mplug-tiny", private=True, api=RecordingApi())
    assert url.endswith(COMMIT)
    [(_, repo, options), (_, repo2, uploaded)] = calls
    assert repo == repo2 == "someorg/mplug-tiny" and options["private"] is True and options["exist_ok"] is True
    assert set(REQUIRED_FILES) <= set(uploaded)
    assert 'MPLUG.from_pretrained("someorg/mplug-tiny")' in (folder / "README.md").read_text()
    with pytest.raises(ConfigError, match="repo_id: expected 'org/name'"):
        push_to_hub(str(folder), "no-org")
