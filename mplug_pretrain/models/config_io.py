"""A model folder's ``config.json``: the ModelConfig written by ``MPLUG.save_pretrained``, read back type-checked."""
from __future__ import annotations

import dataclasses
import json

from mplug_pretrain.models.model_config import ModelConfig
from mplug_pretrain.utils.typed_dataclass import read_json_dataclass

CONFIG_FILE = "config.json"


def write_model_config(config: ModelConfig, path: str) -> None:
    """The config as JSON, without the checkpoint paths (the weights saved beside it already hold what those
    files initialised)."""
    values = dataclasses.asdict(config)
    values["vision"]["checkpoint_path"] = values["text"]["bert_checkpoint"] = None
    values["decoder"]["bert_checkpoint"] = None
    with open(path, "w") as f:
        json.dump(values, f, indent=2)


def read_model_config(path: str) -> ModelConfig:
    """A ``config.json``: a value of the wrong type, an unknown key or a size out of range raises ConfigError
    naming the file and the dotted field ("<path>: model.vision.image_size: expected int, got str '64'")."""
    return read_json_dataclass(ModelConfig, path, "model")
