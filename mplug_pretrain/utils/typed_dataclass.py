"""Nested dataclasses from plain dicts (YAML, JSON, ``key=value`` overrides), checked against the annotations.

    build_dataclass(ModelConfig, json.load(f), "model") -> ModelConfig

Every error is a ConfigError that starts with the dotted field (``model.vision.image_size: expected int,
got str '64'``); unknown keys and missing required fields are named the same way. Ints are accepted for
floats, lists for tuples; nothing else is converted.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

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
        for arg in args:
            if arg is _NONE:
                continue
            try:
                return coerce(value, arg, field)
            except ConfigError:
                pass
        raise ConfigError(f"{field}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"{field}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
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


def build_dataclass(cls: type, values: Any, prefix: str = "", base: Any = None) -> Any:
    """``cls`` from the mapping ``values``, each value checked by ``coerce``. Fields ``values`` leaves out
    keep those of ``base`` (an instance, updated in place and returned) or the class defaults; a field
    without a default must be given. ``prefix`` is the dotted name of ``values`` in error messages."""
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping of {cls.__name__} fields, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        # a key one level too high (caption.beam_size for caption.generation.beam_size) is pointed to its place
        nested = [f"{_join(prefix, name)}.{unknown[0]}" for name in sorted(fields)
                  if dataclasses.is_dataclass(hints[name])
                  and unknown[0] in {f.name for f in dataclasses.fields(hints[name])}]
        hint = f"; did you mean {' or '.join(nested)}?" if nested else ""
        raise ConfigError(f"{_join(prefix, unknown[0])}: unknown key{hint} (expected one of {', '.join(sorted(fields))})")
    checked = {}
    for name, value in values.items():
        field = _join(prefix, name)
        if dataclasses.is_dataclass(hints[name]) and isinstance(value, dict):  # nested: on top of its defaults
            if base is not None:
                current = getattr(base, name)
            else:
                current = _default(fields[name]) if _has_default(fields[name]) else None
            checked[name] = build_dataclass(hints[name], value, field, base=current)
        else:
            checked[name] = coerce(value, hints[name], field)
    if base is None:
        missing = [name for name, f in fields.items() if name not in checked and not _has_default(f)]
        if missing:
            raise ConfigError(f"{_join(prefix, missing[0])}: required, missing")
        return cls(**checked)
    for name, value in checked.items():
        setattr(base, name, value)
    return base


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    """A fresh default value of a field that has one."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return copy.deepcopy(f.default)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def read_json_dataclass(cls: type, path: str, prefix: str = "", values: Any = None) -> Any:
    """``build_dataclass`` of the JSON object in the file ``path`` (or of ``values``, already read from it), then
    ``validate(prefix)`` when ``cls`` has one; a ConfigError starts with the path, then names the field:
    "<path>: model.vision.heads: ..."."""
    if values is None:
        with open(path) as f:
            values = json.load(f)
    try:
        obj = build_dataclass(cls, values, prefix)
        if hasattr(obj, "validate"):
            obj.validate(prefix)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    return obj
