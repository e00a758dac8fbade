"""Checkpoints that continue a run as if it never stopped, and that are safe to receive from someone else.

Layout: ``<run>/checkpoints/<tag>/`` holds DeepSpeed's files (module incl. momentum encoders and
queue buffers + pointers, optimizer partitions), ``trainer_state_rank<R>.pt`` (global step,
samples seen, data position, LR schedule position, RNG states of python/numpy/torch[/cuda]), the run's
``config.yaml`` and the module's ``model_config.json`` (what ``mplug export`` builds), and, written last,
``complete.json``: the completeness marker (step, world size, the size of every file of the tag).
``<run>/checkpoints/latest`` names the newest complete tag: it is written after the marker,
atomically (utils/atomic_files.py), so a write killed half-way leaves the previous ``latest`` loadable.
``<run>/checkpoints/ledger.json`` is the run's own record of the tags it wrote (``started``, then ``complete``).
Pruning keeps the last ``keep_last`` complete tags and deletes only tags the ledger names, never through a
symlink: a user's ``step1/``, a copied tag and any folder of another run stay. A save whose tag folder exists and
is not the run's own is refused, and a symlinked ``checkpoints/`` is refused at start (``refuse_symlinked``).

Resume (``resolve_resume``) checks the tag against its marker before anything is loaded; a damaged newest
tag (a file deleted or truncated, the marker missing) is skipped with a warning for the newest complete one.
A write that fails (disk full) removes the partial tag and names the folder and its free space.

Loading never unpickles arbitrary objects: every ``.pt`` file of a tag is scanned first
(models/weights/reader.py) and DeepSpeed's own ``torch.load`` calls run with ``weights_only=True`` and an
allow-list of the few DeepSpeed classes its files hold (``deepspeed_safe_globals``).
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from mplug_pretrain.errors import DataError
from mplug_pretrain.models.weights.reader import (
    UnsafeFileError,
    read_torch_file,
    refuse_unsafe,
    refused_object,
    weights_only_loads,
)
from mplug_pretrain.utils.atomic_files import atomic_write, write_json_atomic, write_text_atomic
from mplug_pretrain.utils.process_group import barrier

LATEST = "latest"
COMPLETE = "complete.json"  # the completeness marker, written last in each tag
MODEL_CONFIG = "model_config.json"  # the trained module's architecture (export builds it)
RUN_CONFIG = "config.yaml"  # the run config in effect when the tag was written
LEDGER = "ledger.json"  # {tag: "started" | "complete"}: the tags this run wrote, the only ones pruning deletes
_TAG = re.compile(r"^step(\d+)$")


class CheckpointError(DataError):
    """A checkpoint cannot be written or loaded; the message names the folder or file and what to do."""


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


def deepspeed_safe_globals() -> list:
    """The classes DeepSpeed (0.19) stores in its checkpoint files besides tensors and plain containers: the
    loss scaler (a few numbers), the ZeRO stage enum and the parameter-fragment addresses (two ints)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def refuse_unsafe_tag(tag_dir: str) -> None:
    """Scan every torch file of a tag (DeepSpeed's and ours) before any of them is loaded."""
    allowed = deepspeed_safe_globals()
    for name in sorted(os.listdir(tag_dir)):
        if name.endswith(".pt"):
            refuse_unsafe(os.path.join(tag_dir, name), allowed)


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


# ----------------------------------------------------------------------------------------------- save
def save_checkpoint(engine, ckpt_dir: str, state: TrainerState, rank: int, keep_last: int, world_size: int = 1,
                    run_config: str | None = None, task: str | None = None, layout: dict | None = None) -> str:
    """Collective: every rank calls it. ``run_config``: the run's config.yaml text, kept in the tag; ``task``:
    the task's name, kept in the marker; ``layout``: the batch layout, kept in the marker (train/world_change.py).
    Returns the tag written."""
    tag = tag_for(state.global_step)
    tag_dir = os.path.join(ckpt_dir, tag)
    if os.path.lexists(tag_dir) and tag != read_latest(ckpt_dir):
        refuse_foreign(ckpt_dir, tag)  # every rank: they all stop, none waits at the barrier
        if rank == 0:
            shutil.rmtree(tag_dir)  # left by an attempt killed while saving, or damaged: never mix two writes
    if rank == 0:
        _record(ckpt_dir, tag, "started")
    barrier()
    try:
        engine.save_checkpoint(ckpt_dir, tag=tag, save_latest=False)
        if os.environ.get("MPLUG_TEST_KILL_DURING_SAVE_AT_STEP") == str(state.global_step):
            os.kill(os.getpid(), 9)  # fault injection for tests: die after the weights, before `latest`
        payload = {"trainer": asdict(state), "rng": capture_rng()}
        with atomic_write(os.path.join(tag_dir, f"trainer_state_rank{rank}.pt"), "wb") as f:
            torch.save(payload, f)
        if rank == 0:
            _write_tag_configs(engine, tag_dir, run_config)
    except (OSError, RuntimeError) as err:
        raise _write_failed(ckpt_dir, tag, err) from err
    _barrier_while_saving(ckpt_dir, tag)
    if rank == 0:
        try:
            _write_marker(tag_dir, state.global_step, world_size, task, layout)
        except OSError as err:
            raise _write_failed(ckpt_dir, tag, err) from err
        _write_latest(ckpt_dir, tag)
        _record(ckpt_dir, tag, "complete")
        _prune(ckpt_dir, keep_last)
    _barrier_while_saving(ckpt_dir, tag)
    return tag


def _barrier_while_saving(ckpt_dir: str, tag: str) -> None:
    """The barrier after a rank's writes: when another rank failed writing (and so left the group), this rank
    names the checkpoint and the disk's free space rather than the transport's "Connection closed by peer"."""
    try:
        barrier()
    except RuntimeError as err:
        if isinstance(err, DataError):
            raise
        free = shutil.disk_usage(ckpt_dir).free
        full = free < 16 * 2**20
        raise CheckpointError(
            f"{ckpt_dir}: another rank stopped while checkpoint {tag} was being written"
            f"{': the disk is full' if full else ''} ({_mb(free)} free there; its own error, printed above, says "
            "why). `latest` still names the previous complete tag: free space if needed, then continue with "
            "--resume latest") from err


def _write_tag_configs(engine, tag_dir: str, run_config: str | None) -> None:
    module_config = getattr(engine.module, "config", None)
    if module_config is not None:
        from mplug_pretrain.models.folder.config_io import write_model_config
        write_model_config(module_config, os.path.join(tag_dir, MODEL_CONFIG))
    if run_config is not None:
        write_text_atomic(os.path.join(tag_dir, RUN_CONFIG), run_config)


def _tag_files(tag_dir: str) -> dict[str, int]:
    """Every file of a tag (relative path -> size in bytes), the marker excepted."""
    out = {}
    for root, _, names in os.walk(tag_dir):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, tag_dir)
            if rel != COMPLETE and not name.startswith("."):
                out[rel] = os.path.getsize(path)
    return out


def _write_marker(tag_dir: str, step: int, world_size: int, task: str | None, layout: dict | None = None) -> None:
    marker = {"step": step, "world_size": world_size, "task": task, "files": _tag_files(tag_dir)}
    if layout:
        marker["layout"] = layout
    write_json_atomic(os.path.join(tag_dir, COMPLETE), marker, sort_keys=True)


def _write_failed(ckpt_dir: str, tag: str, err: BaseException) -> CheckpointError:
    """Remove the partial tag; an error naming the folder, its free space and whether the disk is full."""
    tag_dir = os.path.join(ckpt_dir, tag)
    # torch's zip writer reports a full disk as a short write ("unexpected pos", "file write failed")
    full = (getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(err)
            or shutil.disk_usage(ckpt_dir).free < 16 * 2**20)
    shutil.rmtree(tag_dir, ignore_errors=True)
    free = shutil.disk_usage(ckpt_dir).free
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    latest = read_latest(ckpt_dir)
    previous = tag_size(ckpt_dir, latest) if latest else None
    need = f"; the previous tag {latest} takes {_mb(previous)}" if previous else ""
    return CheckpointError(
        f"{ckpt_dir}: writing checkpoint {tag} failed{': the disk is full' if full else ''} ({text}); "
        f"{_mb(free)} free there{need}. The partial {tag} was removed and `latest` still names "
        f"{latest or 'no checkpoint'}. Free space (or lower run.keep_last, or move run.output_dir), then "
        "continue with --resume latest")


def _mb(size: int | None) -> str:
    return f"{(size or 0) / 2**20:.1f} MiB"


def tag_size(ckpt_dir: str, tag: str) -> int:
    return sum(_tag_files(os.path.join(ckpt_dir, tag)).values())


def _write_latest(ckpt_dir: str, tag: str) -> None:
    write_text_atomic(os.path.join(ckpt_dir, LATEST), tag)


def name_latest(ckpt_dir: str, tag: str) -> None:
    """Point ``latest`` at ``tag`` (after a resume skipped a damaged newer tag, so that it names a complete one;
    the damaged tag is then newer than ``latest`` and the next save prunes it)."""
    if read_latest(ckpt_dir) != tag:
        _write_latest(ckpt_dir, tag)


def read_latest(ckpt_dir: str) -> str | None:
    path = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    return tag if tag and os.path.isdir(os.path.join(ckpt_dir, tag)) else None


def _steps_and_tags(ckpt_dir: str) -> list[tuple[int, str]]:
    return sorted((int(m.group(1)), name) for name in os.listdir(ckpt_dir) if (m := _TAG.match(name)))


def read_ledger(ckpt_dir: str) -> dict[str, str]:
    """{tag: "started" | "complete"} of the tags this run wrote ({} when none, or the file is not ours)."""
    try:
        with open(os.path.join(ckpt_dir, LEDGER)) as f:
            ledger = json.load(f)
    except (OSError, ValueError):
        return {}
    tags = ledger.get("tags") if isinstance(ledger, dict) else None
    return {k: v for k, v in tags.items() if _TAG.match(k) and v in ("started", "complete")} \
        if isinstance(tags, dict) else {}


def _record(ckpt_dir: str, tag: str, status: str | None) -> None:
    """Rank 0: note ``tag`` as started / complete in the ledger, or (None) drop it."""
    tags = read_ledger(ckpt_dir)
    if status is None:
        tags.pop(tag, None)
    else:
        tags[tag] = status
    write_json_atomic(os.path.join(ckpt_dir, LEDGER), {"tags": dict(sorted(tags.items()))}, sort_keys=True)


def refuse_foreign(ckpt_dir: str, tag: str) -> None:
    """CheckpointError when ``checkpoints/<tag>`` exists but this run did not write it (a user's folder, a copy
    from another run, a symlink): it is never deleted or written into."""
    path = os.path.join(ckpt_dir, tag)
    if os.path.islink(path) or tag not in read_ledger(ckpt_dir):
        raise CheckpointError(f"{path}: exists and was not written by this run ({os.path.join(ckpt_dir, LEDGER)} "
                              "does not name it); the checkpoint of this step would replace it. Move it out of "
                              "checkpoints/, then continue with --resume latest")


def refuse_symlinked(ckpt_dir: str) -> None:
    """A symlinked checkpoints/ folder is refused: pruning deletes there, and the target may be shared."""
    if os.path.islink(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: a symlink (to {os.path.realpath(ckpt_dir)}); checkpoints are pruned in "
                              "this folder, so it must be the run's own. Point run.output_dir at the other storage "
                              "instead")


def _prune(ckpt_dir: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete tags; drop older ones and half-written ones, of those the ledger
    names only (real folders, never through a symlink). Everything else in the folder stays."""
    latest = read_latest(ckpt_dir)
    latest_step = int(_TAG.match(latest).group(1)) if latest else -1
    ledger = read_ledger(ckpt_dir)
    ours = [(step, name) for step, name in _steps_and_tags(ckpt_dir) if name in ledger
            and os.path.isdir(os.path.join(ckpt_dir, name)) and not os.path.islink(os.path.join(ckpt_dir, name))]
    # complete: recorded so, or its marker checks (killed between writing `latest` and the ledger)
    done = {name for _, name in ours if ledger[name] == "complete" or tag_problem(ckpt_dir, name) is None}
    complete = [name for step, name in ours if step <= latest_step and name in done]
    # half-written (an attempt killed while saving) or newer than `latest` (damaged, skipped by a resume)
    stale = [name for step, name in ours if name != latest and (step > latest_step or name not in done)]
    for name in complete[:-keep_last] + stale:
        shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
        if not os.path.exists(os.path.join(ckpt_dir, name)):
            _record(ckpt_dir, name, None)


def newer_complete_tags(ckpt_dir: str, tag: str) -> list[str]:
    """This run's complete tags with a higher step than ``tag`` (a resume from ``tag`` would overwrite or prune
    them; a folder the run did not write is never touched, and a save onto it is refused)."""
    step = int(_TAG.match(tag).group(1)) if _TAG.match(tag) else None
    if step is None or not os.path.isdir(ckpt_dir):
        return []
    ledger = read_ledger(ckpt_dir)
    return [name for other, name in _steps_and_tags(ckpt_dir) if other > step and name in ledger
            and not os.path.islink(os.path.join(ckpt_dir, name)) and tag_problem(ckpt_dir, name) is None]


def check_newer_tags(ckpt_dir: str, tag: str, discard: bool) -> list[str]:
    """Resuming from ``tag`` while newer complete tags exist: refused (they hold later work the resumed run would
    replace) unless ``discard`` (run.discard_newer=true); -> the newer tags."""
    newer = newer_complete_tags(ckpt_dir, tag)
    if newer and not discard:
        raise CheckpointError(f"{os.path.join(ckpt_dir, tag)}: {', '.join(newer)} {'is' if len(newer) == 1 else 'are'} "
                              f"newer and complete; resuming from {tag} would replace that work. Resume with --resume "
                              "latest, or add run.discard_newer=true to delete the newer tag(s) of this run and go on "
                              f"from {tag} (copy the run folder first to keep both)")
    return newer


def discard_newer(ckpt_dir: str, tag: str) -> list[str]:
    """Rank 0, ``run.discard_newer=true``: delete this run's complete tags newer than ``tag``; -> their names."""
    gone = newer_complete_tags(ckpt_dir, tag)
    for name in gone:
        shutil.rmtree(os.path.join(ckpt_dir, name))
        _record(ckpt_dir, name, None)
    name_latest(ckpt_dir, tag)
    return gone


# ----------------------------------------------------------------------------------------------- resume
def read_marker(tag_dir: str) -> dict | None:
    try:
        with open(os.path.join(tag_dir, COMPLETE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tag_problem(ckpt_dir: str, tag: str) -> str | None:
    """Why ``tag`` cannot be loaded (no marker, a file missing or of another size), or None when it is complete.
    A tag without a marker is trusted only when no older tag has one (it was written before markers existed)."""
    tag_dir = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(tag_dir):
        return "no such folder"
    marker = read_marker(tag_dir)
    if marker is None:
        # a tag written before markers existed is older than every marked one: trusted as it is
        step = int(_TAG.match(tag).group(1)) if _TAG.match(tag) else None
        if any(read_marker(os.path.join(ckpt_dir, name)) for other, name in _steps_and_tags(ckpt_dir)
               if step is None or other < step):
            return f"no {COMPLETE} (its write never finished)"
        return None
    for rel, size in sorted(marker.get("files", {}).items()):
        path = os.path.join(tag_dir, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != size:
            return f"{rel} is {os.path.getsize(path)} bytes, {size} when written (truncated or replaced)"
    return None


def partitioned_layout(tag_dir: str) -> bool:
    """True when the DeepSpeed tag holds ZeRO 1-3 optimizer partitions (``*optim_states.pt``), not ZeRO-0's layout."""
    return os.path.isdir(tag_dir) and any("optim_states" in f for f in os.listdir(tag_dir))


def saved_world_size(ckpt_dir: str, tag: str) -> int | None:
    """Ranks that wrote ``tag``: its marker's record, else its trainer_state_rank<R>.pt files."""
    marker = read_marker(os.path.join(ckpt_dir, tag))
    if marker and "world_size" in marker:
        return int(marker["world_size"])
    ranks = [n for n in os.listdir(os.path.join(ckpt_dir, tag)) if re.match(r"^trainer_state_rank\d+\.pt$", n)]
    return len(ranks) or None


def saved_run_config(ckpt_dir: str, tag: str) -> str | None:
    """The config a tag was written under: its own copy, else (older tags) the run folder's config.yaml."""
    for path in (os.path.join(ckpt_dir, tag, RUN_CONFIG), os.path.join(os.path.dirname(ckpt_dir), RUN_CONFIG)):
        if os.path.isfile(path):
            return path
    return None


def resolve_resume(resume: str | None, ckpt_dir: str) -> tuple[str | None, list[str]]:
    """``latest`` (must exist), ``auto`` (latest if any), a tag name, or None -> (tag to load, warnings).
    ``latest`` / ``auto`` fall back from a damaged newest tag to the newest complete one, with a warning;
    a tag named explicitly must be complete."""
    if resume in (None, "", "none"):
        return None, []
    if resume not in ("latest", "auto"):
        problem = tag_problem(ckpt_dir, resume)
        if problem:
            complete = [name for _, name in _steps_and_tags(ckpt_dir) if tag_problem(ckpt_dir, name) is None] \
                if os.path.isdir(ckpt_dir) else []
            raise CheckpointError(f"{os.path.join(ckpt_dir, resume)}: cannot use this tag: {problem}; complete tags "
                                  f"here: {', '.join(complete) or 'none'}")
        return resume, []
    latest = read_latest(ckpt_dir) if os.path.isdir(ckpt_dir) else None
    if latest is None:
        if resume == "latest":
            raise CheckpointError(f"{ckpt_dir}/{LATEST}: no checkpoint to resume from")
        return None, []
    latest_step = int(_TAG.match(latest).group(1)) if _TAG.match(latest) else None
    candidates = [name for step, name in reversed(_steps_and_tags(ckpt_dir))
                  if latest_step is None or step <= latest_step]
    if latest not in candidates:
        candidates.insert(0, latest)
    warnings = []
    for tag in candidates:
        problem = tag_problem(ckpt_dir, tag)
        if problem is None:
            return tag, warnings
        warnings.append(f"[train] warning: checkpoint {tag} is damaged ({problem}); skipping it")
    raise CheckpointError(f"{ckpt_dir}: no complete checkpoint to resume from ({'; '.join(warnings)})")


def load_checkpoint(engine, ckpt_dir: str, tag: str, rank: int) -> TrainerState:
    """Restore module, optimizer and this rank's trainer state + RNG; returns the trainer state."""
    tag_dir = os.path.join(ckpt_dir, tag)
    refuse_unsafe_tag(tag_dir)
    try:
        with weights_only_loads(deepspeed_safe_globals()):  # DeepSpeed's loads pass weights_only=False
            load_path, _ = engine.load_checkpoint(ckpt_dir, tag=tag, load_module_strict=True,
                                                  load_optimizer_states=True, load_lr_scheduler_states=False)
    except pickle.UnpicklingError as err:  # what the scan could not see (a legacy-format file)
        raise UnsafeFileError(f"{tag_dir}: refused: {refused_object(err)}") from err
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{tag_dir}: cannot be loaded into this run's model and optimizer: {first}") from err
    if load_path is None:
        raise CheckpointError(f"{tag_dir}: DeepSpeed could not load this checkpoint")
    path = os.path.join(tag_dir, f"trainer_state_rank{rank}.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; was the checkpoint written with a different world size?")
    payload = read_torch_file(path)
    restore_rng(payload["rng"])
    return TrainerState(**payload["trainer"])


def read_trainer_states(ckpt_dir: str, tag: str, world: int) -> list[TrainerState]:
    """Every rank's trainer state of ``tag`` (written by ``world`` ranks), rank order; RNG states not restored."""
    states = []
    for rank in range(world):
        path = os.path.join(ckpt_dir, tag, f"trainer_state_rank{rank}.pt")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (the tag's marker says {world} rank(s) wrote it)")
        states.append(TrainerState(**read_torch_file(path)["trainer"]))
    return states
