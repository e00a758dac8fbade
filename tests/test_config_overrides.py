"""Command-line overrides: a str field keeps the text as typed (issue 20: ``eval.video_name_format={}``
became a YAML mapping), every other field gets the YAML reading; the checkpoint retention default."""
from __future__ import annotations

import os

import pytest

from mplug_pretrain.config import Config, load_config
from mplug_pretrain.errors import ConfigError


@pytest.mark.parametrize("text", ["{}", "video{}", "[x]", "007", "true", "1e-4", "a: b"])
def test_a_str_field_keeps_the_text_as_typed(text):
    cfg = load_config(None, [f"eval.video_name_format={text}" if "{}" in text else f"run.name={text}"],
                      check_paths=False)
    value = cfg.eval.video_name_format if "{}" in text else cfg.run.name
    assert value == text and type(value) is str


def test_yaml_quoting_still_works_and_other_types_are_read_as_yaml():
    cfg = load_config(None, ['eval.video_name_format="{}"', "optim.lr_rest=3e-5", "eval.image_root=null",
                             "optim.max_steps=7", "run.tensorboard=false", "model.heads.loss_weights.itc=4"],
                      check_paths=False)
    assert cfg.eval.video_name_format == "{}"
    assert cfg.optim.lr_rest == 3e-5 and cfg.eval.image_root is None and cfg.optim.max_steps == 7
    assert cfg.run.tensorboard is False
    assert cfg.model.heads.loss_weights["itc"] == 4 and type(cfg.model.heads.loss_weights["itc"]) is int
    assert "CommandLineValue" not in repr(cfg)


def test_non_str_fields_still_refuse_text():
    with pytest.raises(ConfigError, match="optim.max_steps: expected int"):
        load_config(None, ["optim.max_steps=soon"], check_paths=False)
    with pytest.raises(ConfigError, match="run.tensorboard"):
        load_config(None, ["run.tensorboard={}"], check_paths=False)


def test_checkpoints_kept_by_default(tmp_path):
    """Run folders grew by a full checkpoint every save (tiny: 173 MB); two are kept unless asked otherwise."""
    from mplug_pretrain.train.checkpoint import _prune, _write_latest, tag_for
    keep = Config().run.keep_last
    assert keep == 2
    for step in (10, 20, 30, 40):
        os.makedirs(tmp_path / tag_for(step))
        _write_latest(str(tmp_path), tag_for(step))
        _prune(str(tmp_path), keep)
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("step")) == [tag_for(30), tag_for(40)]
