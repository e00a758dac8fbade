"""Atomic JSON files: metrics, predictions, submissions and bench results are written to ``<path>.tmp`` and
renamed over ``path``, so a reader (or a job killed mid-write) never sees half a file."""
from __future__ import annotations

import json
import os
from typing import Any


def write_json_atomic(path: str, value: Any, indent: int | None = 2) -> None:
    """Write ``value`` as JSON to ``path`` (parent folders created) by temporary file + ``os.replace``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=indent)
    os.replace(tmp, path)
