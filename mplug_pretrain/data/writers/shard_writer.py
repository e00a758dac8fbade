"""Rolling tar shards ``OUT/NAME-%06d.tar`` plus ``manifest.json`` (see ``manifest.py``).

A sample is a dict: ``{"__key__": str, "jpg"|"png"|"mp4"|...: bytes, "txt": str, "json": dict}``.
Values are stored as one tar member per extension (``KEY.EXT``), the WebDataset layout:
bytes as they are, ``str`` as UTF-8, ``dict``/``list`` as JSON.

Like ``webdataset.ShardWriter`` a new shard starts when the current one holds ``max_samples``
samples or adding the next sample would pass ``max_bytes`` (tar members incl. 512-byte headers;
a single larger sample gets a shard of its own). Unlike it, each shard is written to a temporary file and
renamed when complete (utils/atomic_files.py), no empty shard is created, keys are checked unique, and the manifest with
per-shard sample counts is written by ``close()`` only when every sample arrived.
"""
from __future__ import annotations

import json
import os
import re

import webdataset as wds

import mplug_pretrain
from mplug_pretrain.data.formats.manifest import read_manifest, write_manifest_entry
from mplug_pretrain.errors import DataError
from mplug_pretrain.utils.atomic_files import AtomicFile

_KEY = re.compile(r"^[A-Za-z0-9_\-/]+$")  # no dots: the reader splits KEY.EXT at the first dot
_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")
TAR_BLOCK = 512


def created_by(description: str) -> str:
    return f"mplug_pretrain {mplug_pretrain.__version__} {description}".strip()


def encode_value(key: str, ext: str, value) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True).encode("utf-8")
    raise DataError(f"sample {key!r}: field {ext!r} has type {type(value).__name__}; "
                    "expected bytes, str, dict or list")


def member_bytes(payload: int) -> int:
    """Bytes one tar member takes: header block + data padded to whole blocks."""
    return TAR_BLOCK + -(-payload // TAR_BLOCK) * TAR_BLOCK


class ShardWriter:
    """``with ShardWriter(out, "train", kind="image-text", max_samples=1000) as w: w.write(sample)``.

    ``extra`` is stored in the manifest entry (e.g. ``layout``, ``answer_list``).
    """

    def __init__(self, out: str, name: str, *, kind: str, created_by: str, max_samples: int = 1000,
                 max_bytes: int | None = None, overwrite: bool = False, extra: dict | None = None):
        if not _NAME.match(name):
            raise DataError(f"shard name {name!r}: use letters, digits, '_' and '-' only")
        if max_samples < 1 or (max_bytes is not None and max_bytes < 1):
            raise DataError(f"shard size: max_samples={max_samples}, max_bytes={max_bytes}: must be >= 1")
        self.out, self.name, self.kind = out, name, kind
        self.max_samples, self.max_bytes = max_samples, max_bytes
        self.created_by, self.extra = created_by, dict(extra or {})
        os.makedirs(out, exist_ok=True)
        previous = read_manifest(out)["datasets"].get(name)
        if previous is not None:
            if not overwrite:
                raise DataError(f"{out}: data set {name!r} already exists ({previous['total']} samples); "
                                "pass overwrite=True (--overwrite) to replace it")
            for shard in previous["shards"]:
                path = os.path.join(out, shard["file"])
                if os.path.exists(path):
                    os.remove(path)
        self.shards: list[dict] = []
        self._keys: set[str] = set()
        self._file: AtomicFile | None = None  # the shard being written
        self._tar: wds.TarWriter | None = None
        self._count = 0
        self._bytes = 0

    def _path(self, index: int) -> str:
        return os.path.join(self.out, f"{self.name}-{index:06d}.tar")

    def _finish_shard(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._file.commit()
        path = self._file.path
        self.shards.append({"file": os.path.basename(path), "samples": self._count,
                            "bytes": os.path.getsize(path)})
        self._file, self._tar, self._count, self._bytes = None, None, 0, 0

    def write(self, sample: dict) -> None:
        key = sample.get("__key__")
        if not isinstance(key, str) or not _KEY.match(key):
            raise DataError(f"sample key {key!r}: use letters, digits, '_', '-', '/' (no dots)")
        if key in self._keys:
            raise DataError(f"sample key {key!r} written twice to data set {self.name!r}")
        self._keys.add(key)
        fields = {"__key__": key}
        for ext, value in sample.items():
            if ext != "__key__":
                fields[ext] = encode_value(key, ext, value)
        size = sum(member_bytes(len(v)) for k, v in fields.items() if k != "__key__")
        if self._tar is not None and (self._count >= self.max_samples or (
                self.max_bytes is not None and self._bytes + size > self.max_bytes)):
            self._finish_shard()
        if self._tar is None:
            self._file = AtomicFile(self._path(len(self.shards)), "wb")
            # mtime 0: the same samples give byte-identical shards
            self._tar = wds.TarWriter(self._file.file, encoder=False, mtime=0)
        self._tar.write(fields)
        self._count += 1
        self._bytes += size

    def close(self) -> dict:
        """Finish the last shard and write the manifest entry; returns it."""
        self._finish_shard()
        if not self.shards:
            raise DataError(f"{self.out}: data set {self.name!r}: no samples were written")
        entry = {"kind": self.kind, "created_by": self.created_by, "shards": self.shards,
                 "total": sum(s["samples"] for s in self.shards), **self.extra}
        write_manifest_entry(self.out, self.name, entry)
        return entry

    def abort(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._file.discard()
            self._file, self._tar = None, None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.entry = self.close()
        else:
            self.abort()


def shard_pattern(out: str, name: str, num_shards: int) -> str:
    """Brace pattern naming all shards of a data set: ``OUT/NAME-{000000..000003}.tar``."""
    if num_shards < 1:
        raise DataError(f"{out}: data set {name!r} has no shards")
    if num_shards == 1:
        return os.path.join(out, f"{name}-000000.tar")
    return os.path.join(out, f"{name}-{{000000..{num_shards - 1:06d}}}.tar")
