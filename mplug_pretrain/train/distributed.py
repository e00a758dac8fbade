"""One distributed init for every launcher, read from the environment each one sets:

    torchrun, deepspeed launcher     RANK / WORLD_SIZE / LOCAL_RANK (deepspeed also sets CROSS_RANK)
    accelerate launch (--multi_gpu)  the same through torch.distributed.run, plus ACCELERATE_* variables
    mpirun (OpenMPI)                 OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK  (also `accelerate launch --cpu`
    mpirun (MPICH, Intel MPI)        PMI_RANK / PMI_SIZE, MPI_LOCALRANKID          with an mpirun hostfile)
    Slurm srun                       SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID
    nothing                          one process (we set the variables ourselves, so DeepSpeed never tries
                                     MPI discovery)
MPI is read before Slurm: mpirun inside an sbatch allocation inherits SLURM_NTASKS but every process has
SLURM_PROCID 0. Multi-node mpirun needs MASTER_ADDR set by the user (single node: 127.0.0.1).

gloo on CPU, nccl on GPU, and a finite timeout: a dead rank fails the job instead of hanging it.

No C++ build on CPU: DeepSpeed's CPU accelerator would JIT-compile its shared-memory all-reduce op
(``deepspeed_shm_comm``, used only by DeepSpeed-Inference's tensor-parallel all-reduce, never by training), which
needs a C++ compiler and leaves ``<TORCH_EXTENSIONS_DIR>/<flavour>/deepspeed_shm_comm/lock`` behind when killed
mid-build; torch then waits on that lock forever, silently. We mark the op incompatible so it is never built.
The ops training does build (``cpu_adam`` with ``distributed.offload_optimizer``) go through
``clear_stale_build_locks``: a lock whose folder saw no write for ``STALE_LOCK_MINUTES`` is removed with a
message naming it; a fresher one (a build in progress) is named, and removed by a watcher thread once it turns
stale, so torch's wait on it ends.
"""
from __future__ import annotations

import contextlib
import datetime
import glob
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from mplug_pretrain.errors import DataError, PeerRankError

STALE_LOCK_MINUTES = 5.0  # a JIT build writes its folder every few seconds; a lock this quiet was left by a kill

# (rank, world size, local rank candidates) per MPI implementation
MPI_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ("PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID")),
)


@dataclass
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    launcher: str


def world_info_from_env(env: dict | None = None) -> WorldInfo:
    env = os.environ if env is None else env
    accelerate = any(key.startswith("ACCELERATE_") for key in env)
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "deepspeed" if "CROSS_RANK" in env else "accelerate" if accelerate else "torchrun"
        return WorldInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), launcher)
    for rank_key, size_key, local_keys in MPI_VARIABLES:
        if rank_key in env and size_key in env:
            local = next((int(env[k]) for k in local_keys if k in env), 0)
            return WorldInfo(int(env[rank_key]), int(env[size_key]), local, "accelerate" if accelerate else "mpi")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        return WorldInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "srun")
    return WorldInfo(0, 1, 0, "single")


def _slurm_master_addr() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if nodelist:
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, check=True, timeout=30).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_launcher_env(info: WorldInfo) -> None:
    """Make RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT present for torch and DeepSpeed."""
    os.environ["RANK"] = str(info.rank)
    os.environ["WORLD_SIZE"] = str(info.world_size)
    os.environ["LOCAL_RANK"] = str(info.local_rank)
    if info.launcher == "srun":
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
        job_id = int(os.environ.get("SLURM_JOB_ID", "0"))
        os.environ.setdefault("MASTER_PORT", str(20000 + job_id % 20000))
    elif info.launcher == "single":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")


def resolve_backend(requested: str = "auto") -> str:
    import torch
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_device(local_rank: int, visible: int) -> int:
    """The CUDA device of a rank: its local rank modulo the visible devices. With one GPU bound to each task
    (srun --gpus-per-task, or a site's cgroup binding) every task sees device 0 while SLURM_LOCALID goes 0..7."""
    return local_rank % max(visible, 1)


def init_distributed(backend: str = "auto", timeout_minutes: float = 30.0) -> WorldInfo:
    """Initialise torch.distributed (through DeepSpeed, which then reuses the group)."""
    import torch
    info = world_info_from_env()
    export_launcher_env(info)
    backend = resolve_backend(backend)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        torch.cuda.set_device(local_device(info.local_rank, torch.cuda.device_count()))
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    fresh_locks = clear_stale_build_locks()
    if fresh_locks:
        watch_build_locks(fresh_locks)
    import deepspeed
    if not torch.cuda.is_available():
        skip_shm_comm_build()
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(minutes=timeout_minutes),
                                   rank=info.rank, world_size=info.world_size)
    return info


def skip_shm_comm_build() -> None:
    """Never JIT-build DeepSpeed's CPU shared-memory comm op (see the module docstring): training all-reduces
    through torch.distributed (gloo) either way."""
    import deepspeed.ops
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)  # DeepSpeed probes once and keeps this dict
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def _last_write(folder: str) -> float:
    times = [os.path.getmtime(folder)]
    for entry in os.scandir(folder):
        try:
            times.append(entry.stat().st_mtime)
        except OSError:
            pass
    return max(times)


def _build_locks(root: str | None) -> list[str]:
    """``$TORCH_EXTENSIONS_DIR/<op>/lock``, else ``<torch's default root>/<flavour>/<op>/lock`` (or under ``root``)."""
    if root is not None or os.environ.get("TORCH_EXTENSIONS_DIR"):
        return sorted(glob.glob(os.path.join(root or os.environ["TORCH_EXTENSIONS_DIR"], "*", "lock")))
    from torch.utils.cpp_extension import get_default_build_root
    return sorted(glob.glob(os.path.join(get_default_build_root(), "*", "*", "lock")))


def _remove_if_stale(lock: str, stale_minutes: float) -> bool:
    """Remove ``lock`` when its folder saw no write for ``stale_minutes`` (naming it on stderr). -> True when
    the lock is gone (removed here or meanwhile)."""
    try:
        quiet = (time.time() - _last_write(os.path.dirname(lock))) / 60.0
        if quiet < stale_minutes:
            return False
        os.remove(lock)
    except FileNotFoundError:
        return True
    print(f"[distributed] removed the stale build lock {lock} (no write in its folder for {quiet:.0f} min: a "
          "build killed half-way left it)", file=sys.stderr, flush=True)
    return True


def clear_stale_build_locks(root: str | None = None, stale_minutes: float = STALE_LOCK_MINUTES) -> list[str]:
    """Remove the stale JIT-build locks; name the fresh ones (a build in progress, or one killed moments ago,
    on which torch would wait without a word). -> the fresh locks left in place."""
    fresh = [lock for lock in _build_locks(root) if not _remove_if_stale(lock, stale_minutes)]
    for lock in fresh:
        print(f"[distributed] build lock {lock} present: another process is compiling that op, or one was killed "
              f"while compiling it (then delete the lock; it is removed here after {stale_minutes:g} min without "
              "a write)", file=sys.stderr, flush=True)
    return fresh


def watch_build_locks(locks: list[str], stale_minutes: float = STALE_LOCK_MINUTES,
                      poll_seconds: float = 10.0) -> threading.Thread:
    """A daemon thread removing each of ``locks`` once it turns stale: torch, waiting on a lock a killed build
    left, then goes on (loading the op, or failing to) instead of waiting forever."""
    def watch() -> None:
        pending = list(locks)
        while pending:
            pending = [lock for lock in pending if not _remove_if_stale(lock, stale_minutes)]
            time.sleep(poll_seconds)

    thread = threading.Thread(target=watch, name="build-lock-watch", daemon=True)
    thread.start()
    return thread


def shutdown_distributed() -> None:
    """Destroy the process group at exit: without it gloo may abort a rank while exiting."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


# what torch.distributed's backends say when the other side of a collective is gone or silent
PEER_ENDED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
PEER_SILENT = ("Timed out", "timed out", "Timeout", "timeout")


def peer_failure(err: BaseException, timeout_minutes: float, rank: int) -> PeerRankError | None:
    """The error a user can act on for a collective that failed because of another rank, else None."""
    if isinstance(err, DataError) or not isinstance(err, RuntimeError):
        return None  # our own errors already name their file or setting
    text = str(err)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    if any(word in text for word in PEER_ENDED):
        return PeerRankError(f"rank {rank}: another rank ended while this one waited for it ({first[:200]}); its "
                             "own error, printed above, says why (a full disk, a bad sample, out of memory)")
    if any(word in text for word in PEER_SILENT):
        return PeerRankError(f"rank {rank}: no answer from another rank within distributed.timeout_minutes="
                             f"{timeout_minutes:g} ({first[:200]}): a rank froze (a hung file system, a deadlocked "
                             "data worker) or was stopped; raise distributed.timeout_minutes if a step or a "
                             "checkpoint legitimately takes longer")
    return None


@contextlib.contextmanager
def naming_peer_failures(timeout_minutes: float) -> Iterator[None]:
    """A collective that fails because another rank froze or ended raises PeerRankError (see peer_failure)."""
    try:
        yield
    except RuntimeError as err:
        failure = peer_failure(err, timeout_minutes, int(os.environ.get("RANK", "0")))
        if failure is None:
            raise
        raise failure from err
