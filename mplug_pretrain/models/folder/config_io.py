"""A model folder's ``config.json``: the ModelConfig written by ``MPLUG.save_pretrained``, read back type-checked.

``format_version`` (an int, :data:`FORMAT_VERSION` when written here; absent = 1, the files written before it
existed) says which layout a file has. A file from a newer version may hold fields this reader does not know:
they are dropped with a warning naming each (the model is built from the fields it knows), where the same key in
a file of this version or older is an error (a typo or a damaged file).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import typing

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.model_config import ModelConfig
from mplug_pretrain.utils.typed_dataclass import read_json_dataclass

CONFIG_FILE = "config.json"
FORMAT_VERSION = 1
# (section, field, value when unset): the settings that load weights from elsewhere when a model is built
WEIGHT_PATH_FIELDS = (("vision", "checkpoint_path", None), ("vision", "backbone_pretrained", False),
                      ("text", "bert_checkpoint", None), ("decoder", "bert_checkpoint", None))
log = logging.getLogger(__name__)


def write_model_config(config: ModelConfig, path: str) -> None:
    """The config as JSON, without the checkpoint paths (the weights saved beside it already hold what those
    files initialised)."""
    values = dataclasses.asdict(config)
    for section, name, empty in WEIGHT_PATH_FIELDS:
        values[section][name] = empty
    default = ModelConfig().vision
    for name in ("backbone", "backbone_kwargs", "backbone_pretrained"):  # our ViT: readable by older readers
        if values["vision"][name] == getattr(default, name):
            del values["vision"][name]
    with open(path, "w") as f:
        json.dump({"format_version": FORMAT_VERSION, **values}, f, indent=2)


def read_model_config(path: str) -> ModelConfig:
    """A ``config.json``: a value of the wrong type, an unknown key or a size out of range raises ConfigError
    naming the file and the dotted field ("<path>: model.vision.image_size: expected int, got str '64'").
    Settings that would read another file (WEIGHT_PATH_FIELDS) are ignored with a warning: never followed."""
    with open(path) as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON: {err}") from err
    if isinstance(values, dict):
        _drop_weight_paths(values, path)
        version = values.pop("format_version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"{path}: format_version: expected an integer >= 1, got {version!r}")
        if version > FORMAT_VERSION:
            dropped = _drop_unknown(ModelConfig, values, "model")
            log.warning("%s: written in format %d, this reader knows up to %d: ignored fields it does not know%s",
                        path, version, FORMAT_VERSION, f" ({', '.join(dropped)})" if dropped else " (none found)")
    return read_json_dataclass(ModelConfig, path, "model", values=values)


def without_weight_paths(config: ModelConfig) -> ModelConfig:
    """A copy of ``config`` that reads no weights file when built (the weights come from elsewhere: a tag)."""
    config = copy.deepcopy(config)
    for section, name, empty in WEIGHT_PATH_FIELDS:
        setattr(getattr(config, section), name, empty)
    return config


def _drop_weight_paths(values: dict, path: str) -> None:
    """Nulls (in place) every setting that would make the model read another file at build time: a model folder
    carries its weights (model.safetensors), so a ``config.json`` someone sends cannot point the loader at a file
    of their choosing (pretrained-tower paths belong to the training config only)."""
    ignored = []
    for section, name, empty in WEIGHT_PATH_FIELDS:
        part = values.get(section)
        if isinstance(part, dict) and part.get(name) not in (None, empty):
            ignored.append(f"model.{section}.{name}")
            part[name] = empty
    if ignored:
        log.warning("%s: ignored %s: a model folder's weights are its model.safetensors; pretrained-tower "
                    "files are named in the training config only", path, ", ".join(ignored))


def _drop_unknown(cls: type, values: dict, prefix: str) -> list[str]:
    """Removes (in place) the keys of ``values`` that ``cls`` has no field for, at every level; -> dotted names."""
    hints = typing.get_type_hints(cls)
    dropped = []
    for key in list(values):
        if key not in hints:
            dropped.append(f"{prefix}.{key}")
            del values[key]
        elif dataclasses.is_dataclass(hints[key]) and isinstance(values[key], dict):
            dropped += _drop_unknown(hints[key], values[key], f"{prefix}.{key}")
    return dropped
