"""Command-line overrides: a str field keeps the text as typed (issue 20: ``eval.video_name_format={}``
became a YAML mapping), every other field gets the YAML reading; the checkpoint retention default."""
from __future__ import annotations

import os

import pytest

from mplug_pretrain.config import Config, load_config
from mplug_pretrain.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    from mplug_pretrain.train.checkpoint import _prune, _record, _write_latest, tag_for
    keep = Config().run.keep_last
    assert keep == 2
    for step in (10, 20, 30, 40):
        os.makedirs(tmp_path / tag_for(step))
        _write_latest(str(tmp_path), tag_for(step))
        _record(str(tmp_path), tag_for(step), "complete")  # as save_checkpoint records the run's own tags
        _prune(str(tmp_path), keep)
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("step")) == [tag_for(30), tag_for(40)]


def test_a_number_in_a_dotted_key_indexes_a_list():
    """`caption.stages.0.steps=5` was refused ("expected a list"): one field of one stage, the rest kept."""
    import yaml
    with open(os.path.join(REPO, "configs", "caption_coco.yaml")) as f:
        stages = yaml.safe_load(f)["caption"]["stages"]
    cfg = load_config(os.path.join(REPO, "configs", "caption_coco.yaml"),
                      ["caption.stages.0.steps=5", "caption.stages.1.lr_rest=1e-7"], check_paths=False)
    assert [s.steps for s in cfg.caption.stages] == [5, stages[1]["steps"]]
    assert cfg.caption.stages[0].lr_rest == stages[0]["lr_rest"] and cfg.caption.stages[1].lr_rest == 1e-7
    assert [s.name for s in cfg.caption.stages] == [s["name"] for s in stages]
    # a list the file does not set: the default list (one xe stage) is indexed
    default = load_config(None, ["caption.stages.0.steps=7", "caption.stages.0.freeze_vision=true"],
                          check_paths=False)
    assert len(default.caption.stages) == 1 and default.caption.stages[0].steps == 7
    assert default.caption.stages[0].freeze_vision is True and default.caption.stages[0].name == "xe"
    with pytest.raises(ConfigError, match=r"caption\.stages\.2: index out of range \(caption\.stages has 2"):
        load_config(os.path.join(REPO, "configs", "caption_coco.yaml"), ["caption.stages.2.steps=5"],
                    check_paths=False)
    with pytest.raises(ConfigError, match=r"caption\.stages\[0\]\.stepz: unknown key"):
        load_config(None, ["caption.stages.0.stepz=5"], check_paths=False)


def test_a_config_is_found_by_name_among_the_shipped_ones(tmp_path, monkeypatch):
    """`--config pretrain_tiny` outside the repository was "not found" though the configs ship in the package."""
    import mplug_pretrain
    monkeypatch.chdir(tmp_path)
    shipped = os.path.join(os.path.dirname(mplug_pretrain.__file__), "configs", "pretrain_tiny.yaml")
    for name in ("pretrain_tiny", "pretrain_tiny.yaml", "configs/pretrain_tiny.yaml"):
        cfg = load_config(name, check_paths=False)
        assert cfg == load_config(shipped, check_paths=False) and cfg.model.preset == "tiny"
    (tmp_path / "pretrain_tiny.yaml").write_text("run: {name: mine}\n")  # a file here wins over the shipped one
    assert load_config("pretrain_tiny.yaml", check_paths=False).run.name == "mine"
    with pytest.raises(ConfigError, match="config file not found .*pretrain_tiny"):
        load_config("pretrain_tinyy", check_paths=False)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("elsewhere/pretrain_tiny.yaml", check_paths=False)


def _bash_words(command_line: str) -> list[str]:
    """The words bash itself makes of ``command_line`` (brace expansion, quotes), one per line."""
    import subprocess
    out = subprocess.run(["bash", "-c", f"printf '%s\\n' {command_line}"], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize("command", ["pretrain", "finetune grounding", "submit pretrain"])
def test_an_unquoted_shard_range_expanded_by_the_shell_is_refused_with_the_quoted_pattern(command, tmp_path):
    """The documented grounding recipe had ``grounding.train_shards=.../train-{000000..000001}.tar`` unquoted: in a
    shell that is two overrides of one key, and the last (one shard of two) would silently win."""
    from tests.helpers import call_mplug
    pattern = f"{tmp_path}/train-{{000000..000002}}.tar"
    key = "grounding.train_shards" if "grounding" in command else "data.train_shards"
    words = _bash_words(f"{key}={pattern}")
    assert len(words) == 3  # bash, not this test, expands the range
    extra = ["--dry-run", "--nodes", "1", "--time", "00:10:00"] if command.startswith("submit") else []
    proc = call_mplug([*command.split(), "--config", "pretrain_tiny", *words, f"run.output_dir={tmp_path / 'runs'}",
                       *extra])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"mplug: config error: {key}: given 3 times on the command line"), proc.stderr
    assert f"'{key}={pattern}'" in proc.stderr  # the quoted pattern to type instead
    assert _bash_words(f"'{key}={pattern}'") == [f"{key}={pattern}"]  # ... which bash leaves as one word
    assert not (tmp_path / "runs").exists()


def test_other_repeats_keep_last_one_wins():
    """Only a brace range's expansion is refused; a script's default then the user's value stays legal."""
    from mplug_pretrain.config_loader import refuse_expanded_brace_ranges
    for items in (["optim.max_steps=30", "optim.max_steps=31"], ["run.name=a", "run.name=b"],
                  ["run.name=a-000", "run.name=a-002"],  # not consecutive
                  ["run.name=a-000", "run.name=b-001"]):  # other text around the number
        refuse_expanded_brace_ranges(items)  # no error
        key, value = items[-1].split("=")
        section, field = key.split(".")
        assert str(getattr(getattr(load_config(None, items, check_paths=False), section), field)) == value
    assert load_config(None, ["optim.max_steps=30", "optim.max_steps=31"], check_paths=False).optim.max_steps == 31
    with pytest.raises(ConfigError, match=r"^data.train_shards: given 2 times on the command line \('s/a-9.tar', "
                                          r"then 's/a-10.tar'\): .* quote it: 'data.train_shards=s/a-\{9..10\}.tar'$"):
        refuse_expanded_brace_ranges(["data.train_shards=s/a-9.tar", "run.name=x", "data.train_shards=s/a-10.tar"])
