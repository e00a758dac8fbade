"""``run.record_sample_keys``: which samples each optimizer step trained on, for auditing the data order.

Each rank appends one JSON line per micro-batch to ``<run>/sample_keys/rank<R>.jsonl``:
``{"step": the optimizer step it belongs to, "epoch": e, "keys": [__key__ of its real rows]}`` (pad rows left
out; a micro-batch skipped for a non-finite loss was still consumed and is listed). On resume the lines of steps
after the checkpoint are dropped (they are trained again), so the files list every consumed sample once, also
across a resume on another number of ranks (the old ranks' files are kept up to the checkpoint).
A line per micro-batch: about 40 bytes per sample (14M samples: ~0.6 GB an epoch), so it is off by default."""
from __future__ import annotations

import glob
import json
import os

from mplug_pretrain.utils.atomic_files import atomic_write

FOLDER = "sample_keys"


def rank_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, FOLDER, f"rank{rank}.jsonl")


def record_keys(run_dir: str, rank: int, step: int, epoch: int, keys: list[str], is_pad) -> None:
    """Append the real rows' keys of one micro-batch (``is_pad``: bool per row, or None)."""
    real = [k for i, k in enumerate(keys) if is_pad is None or not bool(is_pad[i])]
    path = rank_file(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "epoch": epoch, "keys": real}) + "\n")


def truncate_keys(run_dir: str, last_step: int, ranks: list[int] | None = None) -> None:
    """Drop the lines of steps after ``last_step`` from the files of ``ranks`` (None: every rank's file)."""
    paths = (sorted(glob.glob(os.path.join(run_dir, FOLDER, "rank*.jsonl"))) if ranks is None
             else [rank_file(run_dir, r) for r in ranks])
    for path in paths:
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            lines = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
        with atomic_write(path) as f:
            f.writelines(lines)


def read_keys(run_dir: str) -> list[dict]:
    """Every rank's lines: [{"rank", "step", "epoch", "keys"}]."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, FOLDER, "rank*.jsonl"))):
        rank = int(os.path.basename(path)[4:-6])
        with open(path) as f:
            out.extend({"rank": rank, **json.loads(line)} for line in f if line.strip())
    return out
