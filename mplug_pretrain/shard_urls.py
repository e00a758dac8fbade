"""Brace expansion of shard specs: ``a-{000..009}.tar::b-{0..3}.tar`` -> list of paths.

Kept import-light (no webdataset) so config validation stays fast.
"""
from __future__ import annotations

import re

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_ALTERNATIVES = re.compile(r"\{([^{}]*,[^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """Expand numeric ranges ``{000..009}`` (width kept) and alternatives ``{a,b}``."""
    match = _RANGE.search(pattern)
    if match:
        lo, hi = match.group(1), match.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        out = []
        for i in range(int(lo), int(hi) + 1):
            out.extend(expand_braces(pattern[:match.start()] + str(i).zfill(width) + pattern[match.end():]))
        return out
    match = _ALTERNATIVES.search(pattern)
    if match:
        out = []
        for alt in match.group(1).split(","):
            out.extend(expand_braces(pattern[:match.start()] + alt + pattern[match.end():]))
        return out
    return [pattern]


def expand_sources(spec: str) -> list[list[str]]:
    """``'::'``-separated sources, each brace-expanded."""
    return [expand_braces(part.strip()) for part in spec.split("::") if part.strip()]


def expand_urls(spec: str) -> list[str]:
    return [url for source in expand_sources(spec) for url in source]
