"""Generic typed loading of nested dataclasses from YAML dicts and dotted ``key=value`` overrides.

Every error names the dotted field and what was expected, before any work starts.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from mplug_pretrain.errors import ConfigError

_NONE = type(None)
_UNIONS = (Union, types.UnionType)  # Optional[X] and X | None


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in _UNIONS:
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is _NONE:
        return "null"
    return getattr(tp, "__name__", str(tp))


class CommandLineValue(str):
    """The text of a ``key=value`` override, remembering its YAML reading (``.parsed``). A field typed str
    gets the text as typed (``eval.video_name_format={}`` stays "{}", ``run.name=007`` stays "007");
    every other field gets the YAML reading (``optim.lr_rest=3e-5`` -> 3e-05, ``x=null`` -> None)."""

    parsed: Any

    def __new__(cls, text: str, parsed: Any) -> CommandLineValue:  # noqa: PYI034 (3.10 has no typing.Self)
        obj = super().__new__(cls, text)
        obj.parsed = parsed
        return obj


def _admits_str(tp: Any) -> bool:
    return tp is str or (get_origin(tp) in _UNIONS and str in get_args(tp))


def plain(value: Any) -> Any:
    """Command-line values inside containers (dict / list fields) -> their YAML readings."""
    if isinstance(value, CommandLineValue):
        return plain(value.parsed)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def coerce(value: Any, tp: Any, field: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats, lists for tuples."""
    if isinstance(value, CommandLineValue):
        if value.parsed is not None and not isinstance(value.parsed, str) and _admits_str(tp):
            return str(value)  # a str field keeps the text as typed, not YAML's reading of it
        return coerce(value.parsed, tp, field)
    origin = get_origin(tp)
    if tp is Any:
        return plain(value)
    if origin in _UNIONS:
        args = get_args(tp)
        if value is None and _NONE in args:
            return None
        errors = []
        for arg in args:
            if arg is _NONE:
                continue
            try:
                return coerce(value, arg, field)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{field}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"{field}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{field}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return build_dataclass(tp, value, field)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{field}: expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{field}: expected int, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{field}: expected bool (true/false), got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{field}: expected str, got {type(value).__name__} {value!r}")
        return value
    if tp in (tuple, list) or origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{field}: expected a list, got {type(value).__name__} {value!r}")
        args = [a for a in get_args(tp) if a is not Ellipsis]
        items = [coerce(v, args[0], f"{field}[{i}]") if args else v for i, v in enumerate(value)]
        return tuple(items) if (tp is tuple or origin is tuple) else items
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{field}: expected a mapping, got {type(value).__name__} {value!r}")
        return plain(dict(value))
    return plain(value)


def build_dataclass(cls: type, values: dict, prefix: str, base: Any = None) -> Any:
    """Instantiate ``cls`` from ``values`` on top of ``base`` (an instance) or the class defaults."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{_join(prefix, unknown[0])}: unknown key; expected one of {', '.join(sorted(fields))}")
    obj = base if base is not None else cls()
    for name, value in values.items():
        field = _join(prefix, name)
        current = getattr(obj, name)
        if dataclasses.is_dataclass(hints[name]) and isinstance(value, dict):
            setattr(obj, name, build_dataclass(hints[name], value, field, base=current))
        else:
            setattr(obj, name, coerce(value, hints[name], field))
    return obj


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def parse_overrides(items: list[str]) -> dict:
    """``["optim.lr_rest=3e-5", "run.name=x"]`` -> nested dict of ``CommandLineValue``: the text as typed
    plus its YAML reading; ``coerce`` picks one by the field's type."""
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
