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
"""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
from dataclasses import dataclass

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
    import deepspeed
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(minutes=timeout_minutes),
                                   rank=info.rank, world_size=info.world_size)
    return info


def shutdown_distributed() -> None:
    """Destroy the process group at exit: without it gloo may abort a rank while exiting."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
