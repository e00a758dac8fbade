"""This process's place in the job, for any layer (data, eval, train): rank, world size, device.
Before ``train.distributed.init_distributed`` (or without torch.distributed) it is rank 0 of 1."""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    """Waits for every rank; a no-op in a single process."""
    if is_distributed():
        dist.barrier()


def device() -> torch.device:
    """The GPU this rank uses (init_distributed set it from LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
