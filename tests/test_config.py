"""Config: typed loading, overrides, validation errors that name the field, DeepSpeed derivation."""
import json
import os

import pytest
import yaml

from mplug_pretrain.config import config_from_dict, deepspeed_config, load_config, save_config
from mplug_pretrain.errors import ConfigError
from tests.helpers import call_mplug


def write_yaml(tmp_path, data, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_overrides_are_typed_and_nested(tmp_path):
    path = write_yaml(tmp_path, {"optim": {"lr_rest": 2e-4}, "run": {"name": "a"}})
    cfg = load_config(path, ["optim.lr_vision=3e-6", "run.log_every=7", "model.fusion.stride=6"],
                      check_paths=False)
    assert cfg.optim.lr_rest == 2e-4 and cfg.optim.lr_vision == 3e-6
    assert cfg.run.log_every == 7 and cfg.model.fusion.stride == 6
    assert isinstance(cfg.optim.lr_vision, float)


@pytest.mark.parametrize("override, field", [
    (["optim.lr_rest=fast"], "optim.lr_rest"),
    (["optim.lr_rest=-1.0"], "optim.lr_rest"),
    (["model.vision.colour=1"], "model.vision.colour"),
    (["distributed.zero_stage=4"], "distributed.zero_stage"),
    (["distributed.precision=fp8"], "distributed.precision"),
    (["model.fusion.type=full"], "model.fusion.type"),
    (["data.batch_size=0"], "data.batch_size"),
    (["data.batch_size=2.5"], "data.batch_size"),
    (["run.tensorboard=maybe"], "run.tensorboard"),
    (["model.vision.image_size=250"], "model.vision.image_size"),
    (["data.train_shards=/does/not/exist-{000..001}.tar"], "data.train_shards"),
    (["caption.stages=[{cached_features: true, freeze_vision: false}]"], "caption.stages[0].cached_features"),
    (["nosection.x=1"], "nosection"),
])
def test_bad_values_fail_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert str(err.value).startswith(field)


@pytest.mark.parametrize("override, place", [
    ("caption.beam_size=3", "caption.generation.beam_size"),
    ("eval.prompt=a clip of", "eval.generation.prompt"),
    ("vqa.length_penalty=1.0", "vqa.generation.length_penalty"),
])
def test_a_key_one_level_too_high_is_pointed_to_its_section(override, place):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override], check_paths=False)
    key, value = override.split("=")
    assert str(err.value).startswith(f"{key}: unknown key; did you mean {place}?")
    cfg = load_config(None, [f"{place}={value}"], check_paths=False)
    section, _, field = place.split(".")
    assert str(getattr(getattr(cfg, section).generation, field)) == value


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["run.name=rt", "optim.betas=[0.9, 0.98]", "caption.generation.prompt=a photo of"],
                      check_paths=False)
    path = str(tmp_path / "config.yaml")
    save_config(cfg, path)
    again = load_config(path, check_paths=False)
    assert again == cfg


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_config_is_derived(stage):
    cfg = load_config(None, [f"distributed.zero_stage={stage}", "data.batch_size=6", "optim.grad_accum_steps=3",
                             "optim.grad_clip=0.5", "distributed.precision=fp32"], check_paths=False)
    ds = deepspeed_config(cfg, world_size=4)
    assert ds["train_batch_size"] == 6 * 3 * 4
    assert ds["train_micro_batch_size_per_gpu"] == 6 and ds["gradient_accumulation_steps"] == 3
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["bf16"]["enabled"] is False
    assert "optimizer" not in ds and "scheduler" not in ds


def test_template_that_types_a_derived_value_twice_is_refused(tmp_path):
    template = tmp_path / "bad.json"
    template.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match="distributed.template.*train_batch_size"):  # at load time, before work
        load_config(None, [f"distributed.template={template}"])


def test_shipped_configs_load():
    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    files = [f for f in os.listdir(root) if f.endswith(".yaml")]
    assert files
    for name in files:
        load_config(os.path.join(root, name), check_paths=False)


def test_cli_reports_bad_config_before_work(tmp_path):
    path = write_yaml(tmp_path, {"optim": {"warmup_steps": "soon"}})
    proc = call_mplug(["pretrain", "--config", path, f"run.output_dir={tmp_path / 'runs'}"])
    assert proc.returncode == 2
    assert "optim.warmup_steps" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_optional_fields_are_type_checked():
    """`X | None` annotations must be checked like Optional[X] (regression: they were passed through)."""
    # (in a YAML file: on the command line a str field takes the text as typed, "[1, 2]")
    with pytest.raises(ConfigError, match=r"^data\.val_shards: expected str or null"):
        config_from_dict({"data": {"val_shards": [1, 2]}}, check_paths=False)
    with pytest.raises(ConfigError, match=r"^data\.train_weights: expected"):
        load_config(None, ["data.train_shards=a.tar", "data.train_weights=[x]"], check_paths=False)


def test_a_model_folder_with_its_own_vocabulary_brings_it_unless_one_is_given(tmp_path):
    """init_from (and `mplug eval --checkpoint`) with vocab.txt inside: data.tokenizer defaults to the folder,
    so a model trained on another vocabulary is not fed bert-base-uncased ids; an explicit choice wins."""
    folder, other = tmp_path / "model", tmp_path / "other"
    for path in (folder, other):
        path.mkdir()
        (path / "vocab.txt").write_text("[PAD]\n")
    assert config_from_dict({"init_from": str(folder)}, check_paths=False).data.tokenizer == str(folder)
    given = {"init_from": str(folder), "data": {"tokenizer": str(other)}}
    assert config_from_dict(given, check_paths=False).data.tokenizer == str(other)
    (folder / "vocab.txt").unlink()
    assert config_from_dict({"init_from": str(folder)}, check_paths=False).data.tokenizer is None
