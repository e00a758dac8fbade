"""Dotted ``key=value`` overrides on top of a YAML dict, and a dataclass tree back to a YAML-able dict.

The typed building of dataclasses from these dicts is ``utils/typed_dataclass.py`` (shared with model folders'
``config.json``); every error names the dotted field and what was expected, before any work starts.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.utils.typed_dataclass import CommandLineValue


def parse_overrides(items: list[str]) -> dict:
    """``["optim.lr_rest=3e-5", "run.name=x"]`` -> nested dict of ``CommandLineValue``: the text as typed
    plus its YAML reading; ``typed_dataclass.coerce`` picks one by the field's type."""
    nested: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{item}: override must look like dotted.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        value = CommandLineValue(raw, value)
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: conflicts with an earlier override of {part}")
        node[parts[-1]] = value
    return nested


def deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain YAML-able dict (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
