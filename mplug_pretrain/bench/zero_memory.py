"""Per-rank bytes of training state held by a live DeepSpeed engine, measured from its tensors.

Call ``state_bytes(engine)`` between ``engine.backward`` and ``engine.step`` of a step after the first,
so gradients (or their reduced partitions) and the optimizer state both exist. Every tensor reachable from
the module parameters, the ZeRO optimizer's attributes (flat buffers, fp32 master partitions, gradient
partitions; lists and dicts two levels deep) and the wrapped torch optimizer's ``state`` is counted once per
storage (deduplicated by storage address), and put in the first category that reaches it:

- parameters: the module's parameter storages (ZeRO-3: the rank's ``ds_tensor`` partitions; parameters
  under ``stage3_param_persistence_threshold`` stay whole on every rank) and the flat buffers they view;
- gradients: ``p.grad`` and ZeRO attributes whose name contains "grad" (partitions, contiguous buffers);
- optimizer_state: Adam's exp_avg / exp_avg_sq / step and the fp32 master partitions;
- other: remaining ZeRO buffers (communication buckets).

Reference for mixed precision, N parameters, k ranks (ZeRO paper, Rajbhandari et al. 2020, §5): stage 0
2N+2N+12N, stage 1 2N+2N+12N/k, stage 2 2N+(2N+12N)/k, stage 3 16N/k. In fp32 (this CPU bench) DeepSpeed's
stage 1-3 optimizers still keep a separate fp32 master copy: 4N params + 4N/k master + 8N/k Adam + grads.
"""
from __future__ import annotations

import torch

_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
_PARAM_ATTRS = ("bit16_groups_flat", "fp16_partitioned_groups_flat", "parallel_partitioned_bit16_groups",
                "bit16_groups", "fp16_groups")


def _tensors(value, depth: int = 2):
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 0 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth - 1)


class _Ledger:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "other": 0}

    def add(self, category: str, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta" or tensor.numel() == 0:
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.bytes[category] += storage.nbytes()


def state_bytes(engine) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer_state", "other", "total"} bytes held by this rank."""
    ledger = _Ledger()
    params = list(engine.module.parameters())
    for p in params:
        ledger.add("parameters", p.data)  # ZeRO-3: empty unless gathered or persistent
        if getattr(p, "ds_tensor", None) is not None:
            ledger.add("parameters", p.ds_tensor)
    zero = engine.optimizer
    attrs = vars(zero) if zero is not None and zero is not getattr(engine, "basic_optimizer", None) else {}
    for name in _PARAM_ATTRS:
        for t in _tensors(attrs.get(name)):
            ledger.add("parameters", t)
    for p in params:
        if p.grad is not None:
            ledger.add("gradients", p.grad)
    for name, value in attrs.items():
        if "grad" in name.lower():
            for t in _tensors(value):
                ledger.add("gradients", t)
    for name in _MASTER_ATTRS:
        for t in _tensors(attrs.get(name)):
            ledger.add("optimizer_state", t)
    torch_optimizer = getattr(zero, "optimizer", zero) if attrs else engine.basic_optimizer
    torch_optimizer = torch_optimizer or zero
    for state in torch_optimizer.state.values():
        for t in _tensors(state, depth=1):
            ledger.add("optimizer_state", t)
    for name, value in attrs.items():
        for t in _tensors(value):
            ledger.add("other", t)
    out = dict(ledger.bytes)
    out["total"] = sum(ledger.bytes.values())
    return out
