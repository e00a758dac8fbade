"""Range checks of configuration values; each raises ConfigError naming the dotted field."""
from __future__ import annotations

import math

from mplug_pretrain.errors import ConfigError


def check_positive(value: float, field: str, allow_zero: bool = False) -> None:
    """``value`` finite and > 0 (>= 0 with ``allow_zero``), else ConfigError("<field>: expected > 0, got <value>").
    NaN compares false with everything, so it is refused explicitly (YAML reads ``.nan`` / ``.inf``)."""
    if not math.isfinite(value):
        raise ConfigError(f"{field}: expected a finite number {'>= 0' if allow_zero else '> 0'}, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{field}: expected {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_choice(value: str, choices: tuple[str, ...], field: str) -> None:
    """``value`` in ``choices``, else ConfigError("<field>: expected one of a, b, got 'x'")."""
    if value not in choices:
        raise ConfigError(f"{field}: expected one of {', '.join(choices)}, got {value!r}")
