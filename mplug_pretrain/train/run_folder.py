"""One run per run folder: a finished or interrupted run's folder is continued (``--resume``) or replaced on
request (``run.overwrite=true``), never silently mixed with a new run; and two live runs never share one folder.

``claim_run_folder`` (rank 0, before any heavy work):
- a folder that already holds a run (``checkpoints/`` with a tag or ``latest``, or ``log.jsonl``) is refused
  unless the command resumes it or ``run.overwrite`` is true; overwrite first removes the old run's outputs
  (a symlinked output folder loses the link only, never what it points to);
- ``<run>/.lock`` is locked with ``flock`` (exclusive, non-blocking) for the life of the process: a second run
  into the same folder is refused with the holder's pid and host. The kernel drops the lock when the process
  ends, however it ends (kill -9 included), so a stale lock file never blocks anyone.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time

from mplug_pretrain.errors import ConfigError

LOCK_FILE = ".lock"
# what a run writes into its folder; run.overwrite=true removes these before a new run starts
RUN_OUTPUTS = ("checkpoints", "log.jsonl", "tensorboard", "model", "best", "plots", "world.json", "preempted",
               "stage_done.json", "metrics.json")


class RunFolderBusyError(ConfigError):
    """Another live process holds the run folder's lock."""


def holds_a_run(run_dir: str) -> bool:
    """True when ``run_dir`` has a run's log or a checkpoint in it."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    has_checkpoint = os.path.isdir(ckpt_dir) and any(
        name == "latest" or name.startswith("step") for name in os.listdir(ckpt_dir))
    return has_checkpoint or os.path.isfile(os.path.join(run_dir, "log.jsonl"))


class RunFolderLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock``, held until ``release()`` or the process ends."""

    def __init__(self, run_dir: str) -> None:
        self._fd = None
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self._fd)
            self._fd = None
            raise RunFolderBusyError(
                f"run.name: {run_dir} is in use by another run ({holder}); wait for it to end, stop it, or choose "
                "another run.name / run.output_dir") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                       "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())

    def _holder(self) -> str:
        try:
            with open(self.path) as f:
                info = json.load(f)
            return f"pid {info['pid']} on {info['host']}, since {info['since']}"
        except (OSError, ValueError, KeyError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


def claim_run_folder(run_dir: str, resume: str | None, overwrite: bool) -> RunFolderLock:
    """Lock ``run_dir`` for this run; refuse a folder holding another run unless resuming or overwriting.
    Call on rank 0 only, before the model is built."""
    lock = RunFolderLock(run_dir)  # first: never judge (or clear) a folder another live run is writing
    resuming = resume not in (None, "", "none")
    if holds_a_run(run_dir) and not resuming:
        if not overwrite:
            lock.release()
            raise ConfigError(
                f"run.name: {run_dir} already holds a run (checkpoints or log.jsonl); continue it with "
                "--resume latest (or auto), pick another run.name / run.output_dir, or replace it with "
                "run.overwrite=true")
        links = clear_run_outputs(run_dir)
        print(f"[train] run.overwrite=true: removed the previous run's outputs from {run_dir}"
              + (f" (symlinks removed, their targets kept: {', '.join(links)})" if links else ""), flush=True)
    return lock


def clear_run_outputs(run_dir: str) -> list[str]:
    """Remove the previous run's outputs (RUN_OUTPUTS) without following a link: a symlinked ``tensorboard/`` or
    ``checkpoints/`` loses the link only, what it points to stays. -> the names that were links."""
    links = []
    for name in RUN_OUTPUTS:
        path = os.path.join(run_dir, name)
        if os.path.islink(path):
            os.remove(path)
            links.append(name)
        elif os.path.isdir(path):
            shutil.rmtree(path)  # never follows a link found inside (it removes the link)
        elif os.path.exists(path):
            os.remove(path)
    return links
