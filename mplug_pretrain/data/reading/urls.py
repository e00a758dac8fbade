"""Shard specs -> sources: ``"a/train-{000000..000009}.tar::b/part-{0..3}.tar"`` is two sources
(split at ``::``, each brace-expanded with ``braceexpand``, as open_clip does). Optional weights, one
per source (``"1::3"`` or ``[1, 3]``), drive weighted sampling of sources in resampled mode.

A source may also be a local folder (its ``*.tar`` files, sorted: img2dataset's output folder, whose
``.parquet`` / ``_stats.json`` files are not shards) or a glob (``shards/*.tar``, sorted); one that names no
shard is a ConfigError, not a late "no samples".
"""
from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass

import braceexpand

from mplug_pretrain.errors import ConfigError


@dataclass(frozen=True)
class ShardSource:
    shards: tuple[str, ...]
    weight: float = 1.0


def expand_sources(urls: str | Sequence[str], weights: str | Sequence[float] | None = None) -> list[ShardSource]:
    """A list of URLs is one source; a string is split at ``::`` and brace-expanded."""
    if isinstance(urls, str):
        parts = [p.strip() for p in urls.split("::") if p.strip()]
        groups = [tuple(url for q in braceexpand.braceexpand(p) for url in _local_files(q)) for p in parts]
    else:
        groups = [tuple(urls)]
    if not groups or not all(groups):
        raise ConfigError(f"urls: no shards in {urls!r}")
    if weights is None:
        values = [1.0] * len(groups)
    else:
        raw = weights.split("::") if isinstance(weights, str) else list(weights)
        try:
            values = [float(w) for w in raw]
        except ValueError as err:
            raise ConfigError(f"weights: {weights!r} is not a list of numbers") from err
        if len(values) != len(groups):
            raise ConfigError(f"weights: {len(values)} weights for {len(groups)} sources in {urls!r}")
        if any(w < 0 for w in values) or sum(values) <= 0:
            raise ConfigError(f"weights: {values} must be >= 0 with a positive sum")
    return [ShardSource(g, w) for g, w in zip(groups, values)]


def _local_files(url: str) -> list[str]:
    """A folder -> its sorted ``*.tar``; a glob -> its sorted matches; anything else as it is."""
    if "://" in url or url.startswith("pipe:"):
        return [url]
    if os.path.isdir(url):
        found = sorted(glob.glob(os.path.join(glob.escape(url), "*.tar")))
        if not found:
            raise ConfigError(f"urls: folder {url} holds no .tar shards")
        return found
    if glob.has_magic(url) and not os.path.exists(url):
        found = sorted(glob.glob(url))
        if not found:
            raise ConfigError(f"urls: no file matches {url}")
        return found
    return [url]


def all_shards(sources: list[ShardSource]) -> list[str]:
    return [url for source in sources for url in source.shards]
