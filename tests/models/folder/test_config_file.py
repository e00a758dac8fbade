"""The JSON files of a model folder (config.json, preprocessing.json, the decoding settings) are read by the
run config's typed builder (utils/typed_dataclass.py): a wrong type, an unknown key or an impossible size fails
when the folder is opened, with a ConfigError naming the file and the dotted field, not later as a TypeError
or ZeroDivisionError inside the model."""
from __future__ import annotations

import json

import pytest

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.folder.config_io import read_model_config, write_model_config
from mplug_pretrain.models.folder.preprocessing import Preprocessing
from mplug_pretrain.models.generation.settings import AnswerSettings, GenerationSettings
from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.presets import get_preset_config


def edit_json(path, section: str | None, key: str, value) -> None:
    with open(path) as f:
        data = json.load(f)
    (data[section] if section else data)[key] = value
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.fixture
def folder(tmp_path):
    write_model_config(get_preset_config("tiny"), str(tmp_path / "config.json"))
    return tmp_path


def test_a_written_config_reads_back_equal(folder):
    assert read_model_config(str(folder / "config.json")) == get_preset_config("tiny")


@pytest.mark.parametrize("section, key, value, message", [
    ("vision", "image_size", "64", "model.vision.image_size: expected int, got str '64'"),
    ("vision", "imagesize", 64, "model.vision.imagesize: unknown key"),
    ("vision", "heads", 0, "model.vision.heads: expected > 0, got 0"),
    ("text", "heads", 0, "model.text.heads: expected > 0, got 0"),
    ("decoder", "dropout", None, "model.decoder.dropout: expected float"),
    ("fusion", "type", "full", "model.fusion.type: expected one of"),
    (None, "vision", [64], "model.vision: expected a mapping"),
    # issue 37, item 5: sizes that once went to the allocator (width 10^9: 512 GB)
    ("vision", "width", 10**9, "model.vision.width: 1000000000 is above the largest accepted, 16384"),
    ("text", "vocab_size", 10**9, "model.text.vocab_size: 1000000000 is above the largest accepted"),
    ("decoder", "ffn_dim", 2**20, "model.decoder.ffn_dim: 1048576 is above the largest accepted, 65536"),
])
def test_a_bad_config_json_fails_when_the_folder_is_opened(folder, section, key, value, message):
    edit_json(folder / "config.json", section, key, value)
    with pytest.raises(ConfigError) as err:
        MPLUG.from_pretrained(str(folder))  # fails on config.json, before the (absent) weights are read
    assert str(err.value).startswith(f"{folder / 'config.json'}: {message}")


def test_preprocessing_json_is_type_checked_and_needs_an_image_size(tmp_path):
    Preprocessing(image_size=64).save(str(tmp_path))
    assert Preprocessing.load(str(tmp_path)) == Preprocessing(image_size=64)
    edit_json(tmp_path / "preprocessing.json", None, "mean", ["grey", 0.5, 0.5])
    with pytest.raises(ConfigError, match=r"preprocessing\.json: mean\[0\]: expected float, got str"):
        Preprocessing.load(str(tmp_path))
    Preprocessing(image_size=64).save(str(tmp_path))
    with open(tmp_path / "preprocessing.json") as f:
        data = {k: v for k, v in json.load(f).items() if k != "image_size"}
    with open(tmp_path / "preprocessing.json", "w") as f:
        json.dump(data, f)
    with pytest.raises(ConfigError, match=r"preprocessing\.json: image_size: required, missing"):
        Preprocessing.load(str(tmp_path))


@pytest.mark.parametrize("settings", [GenerationSettings(prompt="a photo of", beam_size=2),
                                      AnswerSettings(beam_size=2, max_length=4)])
def test_decoding_settings_saved_beside_the_weights_round_trip_and_are_type_checked(tmp_path, settings):
    settings.save(str(tmp_path))
    assert type(settings).from_model_dir(str(tmp_path)) == settings
    edit_json(tmp_path / settings.FILE, None, "beam_size", "2")
    with pytest.raises(ConfigError, match=rf"{settings.FILE}: beam_size: expected int, got str '2'"):
        type(settings).from_model_dir(str(tmp_path))


def test_format_version_is_written_and_older_files_read(folder, caplog):
    """config.json carries format_version; a file without one (written before it existed) is version 1."""
    with open(folder / "config.json") as f:
        data = json.load(f)
    assert data["format_version"] == 1
    del data["format_version"]
    with open(folder / "config.json", "w") as f:
        json.dump(data, f)
    assert read_model_config(str(folder / "config.json")) == get_preset_config("tiny")
    assert not caplog.records


def test_fields_of_a_newer_format_are_warned_and_ignored(folder, caplog):
    """An unknown key used to be fatal, so any field a newer version adds broke every older reader."""
    edit_json(folder / "config.json", None, "format_version", 2)
    edit_json(folder / "config.json", "vision", "register_tokens", 4)
    edit_json(folder / "config.json", None, "adapter", {"rank": 8})
    with caplog.at_level("WARNING", logger="mplug_pretrain.models.folder.config_io"):
        assert read_model_config(str(folder / "config.json")) == get_preset_config("tiny")
    [record] = caplog.records
    assert "format 2, this reader knows up to 1" in record.getMessage()
    assert "model.vision.register_tokens" in record.getMessage() and "model.adapter" in record.getMessage()
    edit_json(folder / "config.json", "vision", "image_size", "64")  # known fields stay type-checked
    with pytest.raises(ConfigError, match="model.vision.image_size: expected int"):
        read_model_config(str(folder / "config.json"))
    for bad in (0, "2", True):
        edit_json(folder / "config.json", None, "format_version", bad)
        with pytest.raises(ConfigError, match="format_version: expected an integer >= 1"):
            read_model_config(str(folder / "config.json"))


def test_an_absurd_size_is_one_mplug_line_naming_file_and_field(folder, tmp_path):
    from tests.helpers import call_mplug
    edit_json(folder / "config.json", "vision", "width", 10**9)
    image = tmp_path / "x.png"
    image.write_bytes(b"")
    proc = call_mplug(["caption", "--checkpoint", str(folder), str(image)])
    assert proc.returncode == 2
    assert proc.stderr == (f"mplug: config error: {folder / 'config.json'}: model.vision.width: 1000000000 is above "
                           "the largest accepted, 16384 (a damaged or hostile config; nothing was allocated)\n")
