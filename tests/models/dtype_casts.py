"""Counting the dtype casts of activations (not parameters) that a computation dispatches.

``ActivationCasts`` is a TorchDispatchMode: every ``aten._to_copy`` that changes a floating tensor's dtype
and whose source is not a parameter's storage is recorded as (shape, from dtype, to dtype). Autocast's own
casts go through ``_to_copy`` too, so under bf16 autocast this counts what a GPU step spends on re-casting
activations (each a read and a write of the whole tensor). Parameter casts are left out: autocast caches them
once per forward.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ActivationCasts(TorchDispatchMode):
    def __init__(self, parameters):
        super().__init__()
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self.casts: list[tuple[tuple[int, ...], torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            source, dtype = args[0], kwargs.get("dtype")
            if (dtype is not None and dtype != source.dtype and source.is_floating_point()
                    and source.untyped_storage().data_ptr() not in self.parameter_storages):
                self.casts.append((tuple(source.shape), source.dtype, dtype))
        return func(*args, **kwargs)

    @property
    def bytes_moved(self) -> int:
        """Read + write bytes of the recorded casts."""
        return sum(torch.Size(shape).numel() * (torch.empty((), dtype=a).element_size()
                                                 + torch.empty((), dtype=b).element_size())
                   for shape, a, b in self.casts)
