"""ModelConfig <-> plain dict (the ``config.json`` written by ``MPLUG.save_pretrained``)."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.model_config import ModelConfig


def model_config_to_dict(config: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def model_config_from_dict(data: dict[str, Any], prefix: str = "model") -> ModelConfig:
    """Nested dict -> ModelConfig; unknown keys raise ConfigError with their dotted name."""
    return _build(ModelConfig, data, prefix)


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}: unknown field (known: {', '.join(fields)})")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            value = _build(hint, value, f"{prefix}.{name}")
        elif hint is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)
