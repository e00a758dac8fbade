"""Files written whole or not at all: every result, config, manifest, shard and checkpoint pointer of the package
is written to a temporary file beside its target, flushed to disk, then ``os.replace``d over the target. A
reader, or a job killed mid-write, sees the old file or the new one, never half of one.

The temporary name holds the process id and a random part (``.<name>.<pid>.<hex>.tmp``), and it is created
exclusively, so two writers never write into one temporary file. It is created with mode 0o666 like a plain
``open``, so the umask applies (0o644 under umask 022), not ``tempfile.mkstemp``'s 0o600.

    with atomic_write("out/metrics.json") as f:      # a text file object; "wb" gives a binary one
        json.dump(metrics, f)
    write_json_atomic("out/metrics.json", metrics)   # the same in one call
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from typing import IO, Any


class AtomicFile:
    """An open temporary file that becomes ``path`` on ``commit()`` and vanishes on ``discard()``. For writers
    that keep the file open across calls (the shard writer's tar); otherwise use ``atomic_write``."""

    def __init__(self, path: str | os.PathLike, mode: str = "w", encoding: str | None = None) -> None:
        if not mode.startswith("w"):
            raise ValueError(f"mode {mode!r}: an atomic write replaces the whole file ('w' or 'wb')")
        self.path = os.path.abspath(path)
        folder, name = os.path.split(self.path)
        os.makedirs(folder, exist_ok=True)
        self.temporary = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(self.temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self.file: IO = os.fdopen(fd, mode, encoding=encoding)

    def commit(self) -> None:
        """Flush to disk and put the file in place of ``path``."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.temporary, self.path)

    def discard(self) -> None:
        """Drop what was written; ``path`` stays as it was."""
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.temporary)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = None) -> Iterator[IO]:
    """A file object whose content replaces ``path`` (parent folders created) when the block ends normally;
    an exception inside the block leaves ``path`` untouched and removes the temporary file."""
    target = AtomicFile(path, mode, encoding)
    try:
        yield target.file
        target.commit()
    except BaseException:
        target.discard()
        raise


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str | None = None) -> None:
    with atomic_write(path, "w", encoding) as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, value: Any, indent: int | None = 2, sort_keys: bool = False) -> None:
    with atomic_write(path) as f:
        json.dump(value, f, indent=indent, sort_keys=sort_keys)
