"""configs/pretrain_base.yaml sets no CLIP or BERT weights: a 16-GPU job would have pretrained from random
weights without a word (issue 26). Now `mplug pretrain` and `mplug submit pretrain` refuse a base/large model
without them, unless asked, and say how to fix it."""
from __future__ import annotations

import os

import pytest

from mplug_pretrain.cli import main
from mplug_pretrain.config import load_config
from mplug_pretrain.tasks.pretrain.train import random_init_problem
from tests.helpers import REPO_ROOT

BASE = os.path.join(REPO_ROOT, "configs", "pretrain_base.yaml")


def test_pretrain_base_without_weights_is_refused_with_the_fix(demo_shards, tmp_path, capsys):
    argv = ["--config", BASE, f"data.train_shards={demo_shards['pretrain_train']}", f"run.output_dir={tmp_path}"]
    assert main(["pretrain", *argv]) == 2
    err = capsys.readouterr().err
    assert "model.vision.checkpoint_path" in err and "model.text.bert_checkpoint" in err
    assert "run.allow_random_init=true" in err
    assert not (tmp_path / "pretrain_base").exists()  # refused before any run folder or model
    assert main(["submit", "pretrain", *argv, "--time", "01:00:00", "--dry-run"]) == 2
    assert "run.allow_random_init=true" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, refused", [
    ([], True),
    (["model.preset=large"], True),
    (["run.allow_random_init=true"], False),
    (["model.preset=tiny"], False),
    (["init_from=MODEL"], False),
])
def test_which_runs_count_as_random_init(overrides, refused, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    overrides = [o.replace("MODEL", str(tmp_path)) for o in overrides]
    cfg = load_config(BASE, overrides, check_paths=False)
    assert (random_init_problem(cfg) is not None) is refused


def test_one_missing_file_is_named_alone(tmp_path):
    clip = tmp_path / "ViT-B-16.pt"
    clip.touch()
    cfg = load_config(BASE, check_paths=False)
    cfg.model.vision.checkpoint_path = str(clip)
    missing = random_init_problem(cfg).split(" not set")[0]
    assert "model.text.bert_checkpoint" in missing and "model.vision.checkpoint_path" not in missing
