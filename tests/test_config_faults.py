"""Issue 24, item 11: each bad value below used to pass validation and fail later (a traceback inside the model
or DeepSpeed, or a late data error) or not at all. Every one must now fail in ``load_config`` (which every
command calls first) with a ConfigError that starts with the dotted field; through the CLI that is one
``mplug: config error:`` line and exit code 2, before the run folder exists."""
import json
import os

import pytest

from mplug_pretrain.config import load_config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.presets import get_preset_config
from tests.helpers import REPO_ROOT, call_mplug

TINY = os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml")


def _template(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return f"distributed.template={path}"


CASES = [  # (override(s), dotted field the error must start with); {tmp} is the test's folder
    ("model.vision.patch_size=0", "model.vision.patch_size"),
    ("model.vision.heads=0", "model.vision.heads"),
    ("model.text.heads=0", "model.text.heads"),
    ("distributed.timeout_minutes=.nan", "distributed.timeout_minutes"),
    ("optim.lr_rest=.nan", "optim.lr_rest"),
    ("optim.lr_vision=.inf", "optim.lr_vision"),
    ("model.vision.width=0", "model.vision.width"),
    ("model.heads.embed_dim=-4", "model.heads.embed_dim"),
    ("template:not json", "distributed.template"),
    ("model.text.max_positions=8", "model.text.max_positions"),
    ("data.shuffle_buffer=0", "data.shuffle_buffer"),
    ("data.samples_per_epoch=100", "data.samples_per_epoch"),  # exact mode (the tiny config's)
    ('template:{"zero_optimization": {"stage": 2}, "steps_per_print": 5, "steps_per_print": 6}',
     "distributed.template"),
    ('template:{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}', "distributed.template"),
    ("data.tokenizer={tmp}/no_such_tokenizer", "data.tokenizer"),
    ("model.heads.temperature=0", "model.heads.temperature"),
    ("model.heads.distill_alpha=.nan", "model.heads.distill_alpha"),
]


@pytest.fixture
def shard_file(tmp_path):
    path = tmp_path / "train-000000.tar"
    path.write_bytes(b"")  # validation checks that the files exist; nothing is read
    return str(path)


@pytest.mark.parametrize("override, field", CASES, ids=[c[0][:40] for c in CASES])
def test_bad_config_fails_at_load_naming_the_field(tmp_path, shard_file, override, field):
    if override.startswith("template:"):
        override = _template(tmp_path, "template.json", override[len("template:"):])
    override = override.replace("{tmp}", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [f"data.train_shards={shard_file}", override])
    assert str(err.value).startswith(f"{field}:"), str(err.value)


def test_cli_refuses_a_nan_learning_rate_before_the_run_folder_exists(tmp_path, shard_file):
    proc = call_mplug(["pretrain", "--config", TINY, f"data.train_shards={shard_file}", "optim.lr_rest=.nan",
                       f"run.output_dir={tmp_path / 'runs'}"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("mplug: config error: optim.lr_rest:")
    assert not (tmp_path / "runs").exists()


def test_the_limits_themselves_are_accepted(tmp_path, shard_file):
    """The boundaries next to the refused values still load (the checks are not simply stricter everywhere)."""
    cfg = load_config(TINY, [f"data.train_shards={shard_file}", "model.text.max_positions=30", "data.shuffle_buffer=1",
                             "data.mode=resampled", "data.samples_per_epoch=100"])
    assert cfg.model.text.max_positions == cfg.data.max_text_len == 30


@pytest.mark.parametrize("section, key, value, field", [
    ("vision", "image_size", "64", "model.vision.image_size"),
    ("vision", "heads", 0, "model.vision.heads"),
    ("heads", "temperature", 0, "model.heads.temperature"),
])
def test_a_model_folders_bad_config_json_names_file_and_field(tmp_path, section, key, value, field):
    from mplug_pretrain.models.folder.config_io import write_model_config
    path = tmp_path / "config.json"
    write_model_config(get_preset_config("tiny"), str(path))
    data = json.loads(path.read_text())
    data[section][key] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        MPLUG.from_pretrained(str(tmp_path))
    assert str(err.value).startswith(f"{path}: {field}:")
