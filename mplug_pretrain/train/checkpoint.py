"""Checkpoints that continue a run as if it never stopped.

Layout: ``<run>/checkpoints/<tag>/`` holds DeepSpeed's files (module incl. momentum encoders and
queue buffers + pointers, optimizer partitions) and ``trainer_state_rank<R>.pt`` (global step,
samples seen, data position, LR schedule position, RNG states of python/numpy/torch[/cuda]).
``<run>/checkpoints/latest`` names the newest COMPLETE tag: it is written after every rank has
finished writing (barrier), atomically (utils/atomic_files.py), so a write killed half-way
leaves the previous ``latest`` loadable. The last ``keep_last`` tags are kept.

Trainer state is saved as plain tensors/lists/dicts and read with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from mplug_pretrain.utils.atomic_files import atomic_write, write_text_atomic
from mplug_pretrain.utils.process_group import barrier

LATEST = "latest"
_TAG = re.compile(r"^step(\d+)$")


@dataclass
class TrainerState:
    global_step: int = 0  # optimizer steps taken
    samples_seen: int = 0  # samples consumed by all ranks in completed optimizer steps
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed (data position)
    nonfinite_skipped: int = 0
    corrupt_skipped: int = 0  # skipped samples, all ranks (as of the last log step)
    data_counts: dict = field(default_factory=dict)  # this rank's reader counts by kind (DecodeStats), all epochs
    extra: dict = field(default_factory=dict)


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def capture_rng() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": [list(v) if isinstance(v, tuple) else v for v in random.getstate()],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(engine, ckpt_dir: str, state: TrainerState, rank: int, keep_last: int) -> str:
    """Collective: every rank calls it. Returns the tag written."""
    tag = tag_for(state.global_step)
    engine.save_checkpoint(ckpt_dir, tag=tag, save_latest=False)
    if os.environ.get("MPLUG_TEST_KILL_DURING_SAVE_AT_STEP") == str(state.global_step):
        os.kill(os.getpid(), 9)  # fault injection for tests: die after the weights, before `latest`
    payload = {"trainer": asdict(state), "rng": capture_rng()}
    with atomic_write(os.path.join(ckpt_dir, tag, f"trainer_state_rank{rank}.pt"), "wb") as f:
        torch.save(payload, f)
    barrier()
    if rank == 0:
        _write_latest(ckpt_dir, tag)
        _prune(ckpt_dir, keep_last)
    barrier()
    return tag


def _write_latest(ckpt_dir: str, tag: str) -> None:
    write_text_atomic(os.path.join(ckpt_dir, LATEST), tag)


def read_latest(ckpt_dir: str) -> str | None:
    path = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    return tag if tag and os.path.isdir(os.path.join(ckpt_dir, tag)) else None


def _prune(ckpt_dir: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete tags; drop older ones and half-written newer ones."""
    latest = read_latest(ckpt_dir)
    latest_step = int(_TAG.match(latest).group(1)) if latest else -1
    tags = sorted((int(m.group(1)), name) for name in os.listdir(ckpt_dir) if (m := _TAG.match(name)))
    complete = [name for step, name in tags if step <= latest_step]
    stale = [name for step, name in tags if step > latest_step]  # an earlier attempt killed while saving
    for name in complete[:-keep_last] + stale:
        shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)


def load_checkpoint(engine, ckpt_dir: str, tag: str, rank: int) -> TrainerState:
    """Restore module, optimizer and this rank's trainer state + RNG; returns the trainer state."""
    load_path, _ = engine.load_checkpoint(ckpt_dir, tag=tag, load_module_strict=True,
                                          load_optimizer_states=True, load_lr_scheduler_states=False)
    if load_path is None:
        raise RuntimeError(f"{os.path.join(ckpt_dir, tag)}: DeepSpeed could not load this checkpoint")
    path = os.path.join(ckpt_dir, tag, f"trainer_state_rank{rank}.pt")
    if not os.path.isfile(path):
        raise RuntimeError(f"{path}: missing; was the checkpoint written with a different world size?")
    payload = torch.load(path, weights_only=True)
    restore_rng(payload["rng"])
    return TrainerState(**payload["trainer"])


def resolve_resume(resume: str | None, ckpt_dir: str) -> str | None:
    """``latest`` (must exist), ``auto`` (latest if any), a tag name, or None -> tag to load."""
    if resume in (None, "", "none"):
        return None
    if resume in ("latest", "auto"):
        tag = read_latest(ckpt_dir)
        if tag is None and resume == "latest":
            raise FileNotFoundError(f"{ckpt_dir}/{LATEST}: no checkpoint to resume from")
        return tag
    if not os.path.isdir(os.path.join(ckpt_dir, resume)):
        raise FileNotFoundError(f"{os.path.join(ckpt_dir, resume)}: no such checkpoint tag")
    return resume
