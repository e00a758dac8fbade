"""Rows of every rank, concatenated in rank order (ITC keys and queues, ITM's negative pool).

Ranks may hold different row counts (a last partial batch, blank rows dropped), so each gather pads to the largest
count and trims: ``rank_row_counts`` reads every rank's count on the host in one go (one sync, none in a single
process). ``gather_rows_with_grad`` keeps the gradient: in backward every rank's gradient for the gathered rows is
summed (an all-reduce) and each rank takes its own rows' share, so a row another rank used sends its gradient back
to the rank that owns it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mplug_pretrain.utils import process_group


def rank_row_counts(rows: int, device: torch.device) -> list[int]:
    """Every rank's row count, in rank order."""
    world = process_group.world_size()
    if world == 1:
        return [rows]
    counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([rows], device=device))
    return torch.cat(counts).tolist()


def gather_rows(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``x`` [n_rank, ...] of every rank -> [sum(sizes), ...] (no gradient); ``sizes`` from ``rank_row_counts``."""
    world = len(sizes)
    if world == 1:
        return x
    padded = x.new_zeros((max(sizes),) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    chunks = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(chunks, padded.contiguous())
    return torch.cat([c[:s] for c, s in zip(chunks, sizes)])


class _GatherRowsWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        ctx.sizes = sizes
        return gather_rows(x, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # summed in fp32: a bf16 sum over ranks would round once per rank
        total = grad.float().contiguous()
        dist.all_reduce(total)
        start = sum(ctx.sizes[:process_group.rank()])
        return total[start:start + ctx.sizes[process_group.rank()]].to(grad.dtype), None


def gather_rows_with_grad(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``gather_rows`` whose backward returns to each rank the summed gradient of its own rows."""
    if len(sizes) == 1:
        return x
    return _GatherRowsWithGrad.apply(x, sizes)
