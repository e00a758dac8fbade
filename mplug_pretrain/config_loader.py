"""Dotted ``key=value`` overrides on top of a YAML dict, and a dataclass tree back to a YAML-able dict.

A number in a dotted key indexes a list (``caption.stages.0.steps=5``: the first stage's steps, the other stages
and fields kept), whether the list comes from the YAML file or from the class defaults. ``find_config`` resolves
``--config``: a path, else a name among the configs shipped inside the package (``pretrain_tiny``).

The typed building of dataclasses from these dicts is ``utils/typed_dataclass.py`` (shared with model folders'
``config.json``); every error names the dotted field and what was expected, before any work starts.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import yaml

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.utils.typed_dataclass import CommandLineValue


def refuse_expanded_brace_ranges(items: list[str]) -> None:
    """Overrides typed on one command line: ConfigError when one key is given several times with the values of one
    shell brace range. ``key=a-{000000..000001}.tar`` unquoted reaches us as ``key=a-000000.tar key=a-000001.tar``,
    of which the last would silently win (one shard of two); the error shows the quoted pattern to type instead.
    Other repeats keep their meaning: the last one wins (a script's defaults, then the user's)."""
    values: dict[str, list[str]] = {}
    for item in items:
        if "=" in item:
            key, raw = item.split("=", 1)
            values.setdefault(key.strip(), []).append(raw)
    for key, given in values.items():
        pattern = _brace_range(given) if len(given) > 1 else None
        if pattern:
            shown = ", then ".join(repr(v) for v in given)
            raise ConfigError(f"{key}: given {len(given)} times on the command line ({shown}): a shell expanded an "
                              f"unquoted {{..}} range into one word per value; quote it: '{key}={pattern}'")


def _brace_range(values: list[str]) -> str | None:
    """``["a-000.tar", "a-001.tar", "a-002.tar"]`` -> ``"a-{000..002}.tar"``: the values a shell's brace
    expansion of one range gives (the same text around one run of digits, consecutive numbers, zero-padded ones of
    one width), else None. Bare numbers (``optim.max_steps=30``, then ``=31``) are not taken for a range."""
    parts = [re.fullmatch(r"(.*?)(\d+)(\D*)", v) for v in values]
    if not all(parts) or len({(m.group(1), m.group(3)) for m in parts}) != 1:
        return None
    if not (parts[0].group(1) or parts[0].group(3)):
        return None
    if any(m.group(2).startswith("0") and len(m.group(2)) > 1 for m in parts) and \
            len({len(m.group(2)) for m in parts}) != 1:  # zero-padded ranges keep one width
        return None
    numbers = [int(m.group(2)) for m in parts]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return None
    first, last = parts[0], parts[-1]
    return f"{first.group(1)}{{{first.group(2)}..{last.group(2)}}}{first.group(3)}"


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


def deep_merge(base: dict, update: dict, prefix: str = "") -> dict:
    """``update`` on top of ``base``: mappings merged key by key, a mapping of indices into a list item by item."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value, _dotted(prefix, key))
        elif _is_index_map(value) and isinstance(out.get(key), list):
            out[key] = merge_into_list(out[key], value, _dotted(prefix, key))
        else:
            out[key] = value
    return out


def resolve_list_indices(raw: dict, defaults: dict, prefix: str = "") -> dict:
    """Index overrides of lists the YAML file did not set (``caption.stages.0.steps=5`` over the default stages):
    applied to the default list from ``defaults`` (the config's dict before the file)."""
    out = dict(raw)
    for key, value in raw.items():
        default = defaults.get(key) if isinstance(defaults, dict) else None
        if _is_index_map(value) and isinstance(default, list):
            out[key] = merge_into_list(default, value, _dotted(prefix, key))
        elif isinstance(value, dict) and isinstance(default, dict):
            out[key] = resolve_list_indices(value, default, _dotted(prefix, key))
    return out


def merge_into_list(items: list, update: dict, key: str) -> list:
    """``{"0": {"steps": 5}}`` into ``items``: item 0's steps replaced, the rest kept; an index past the end is
    refused (set the whole list to add items)."""
    out = list(items)
    for text, value in sorted(update.items(), key=lambda kv: int(kv[0])):
        index = int(text)
        if index >= len(out):
            raise ConfigError(f"{key}.{index}: index out of range ({key} has {len(out)} item(s); "
                              f"to add items set the whole list, {key}=[...])")
        current = out[index]
        if isinstance(current, dict) and isinstance(value, dict):
            out[index] = deep_merge(current, value, f"{key}.{index}")
        elif _is_index_map(value) and isinstance(current, list):
            out[index] = merge_into_list(current, value, f"{key}.{index}")
        else:
            out[index] = value
    return out


def _is_index_map(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(k, str) and k.isdigit() for k in value)


def _dotted(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


PACKAGE_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def find_config(path: str) -> str:
    """``path`` when it is a file; else, for a name (``pretrain_tiny``, ``pretrain_tiny.yaml``) or a
    ``configs/<name>.yaml`` that is not here, the config of that name shipped in the package. Raises
    ConfigError listing the shipped names when neither exists."""
    if os.path.isfile(path):
        return path
    head, name = os.path.split(path)
    if head in ("", "configs"):
        stem = name.removesuffix(".yaml")
        shipped = os.path.join(PACKAGE_CONFIGS, f"{stem}.yaml")
        if os.path.isfile(shipped):
            return shipped
    names = sorted(f[:-5] for f in os.listdir(PACKAGE_CONFIGS) if f.endswith(".yaml")) \
        if os.path.isdir(PACKAGE_CONFIGS) else []
    raise ConfigError(f"{path}: config file not found (nor a config shipped with mplug_pretrain: "
                      f"{', '.join(names)})")


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain YAML-able dict (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
