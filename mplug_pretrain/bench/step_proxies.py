"""CPU-countable stand-ins for what a training step costs on a GPU, counted with a ``TorchDispatchMode`` (every
aten op the step dispatches is seen once, whatever the device):

    casts_per_step       dtype casts of tensors that are not parameters: ``_to_copy`` to another dtype, and
                         ``copy_`` between dtypes (each is a memory-bound kernel on a GPU; autocast's casts of
                         the weights are counted apart as ``parameter_casts_per_step``)
    ops_per_step         every dispatched op of the step (on a GPU, about one kernel launch each)
    ops_per_block        forward ops per call of each block kind (ViT block, text layer, fusion layer,
                         decoder layer): launch-bound work grows with these at small per-layer sizes
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

BLOCK_KINDS = (("image_encoder.vit.", "vit_block"), ("image_encoder_m.vit.", "vit_block"),
               ("text_encoder.", "text_layer"), ("text_encoder_m.", "text_layer"), ("fusion.", "fusion_layer"),
               ("decoder.", "decoder_layer"))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class StepOpCounter(TorchDispatchMode):
    """Counts ops, casts (of parameters and of other tensors) and forward ops per block kind (``enter`` /
    ``leave`` mark a block's forward)."""

    def __init__(self, parameter_storages: set[int]):
        super().__init__()
        self.parameter_storages = parameter_storages
        self.ops = 0
        self.casts = 0
        self.parameter_casts = 0
        self.block_ops: Counter = Counter()
        self._blocks: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if self._blocks:
            self.block_ops[self._blocks[-1]] += 1
        name = func._overloadpacket.__name__
        source = None
        if name == "_to_copy" and "dtype" in kwargs and kwargs["dtype"] != args[0].dtype:
            source = args[0]
        elif name == "copy_" and isinstance(args[1], torch.Tensor) and args[1].dtype != args[0].dtype:
            source = args[1]
        if source is not None:
            if source.device.type != "meta" and _storage(source) in self.parameter_storages:
                self.parameter_casts += 1
            else:
                self.casts += 1
        return func(*args, **kwargs)

    def enter(self, kind: str) -> None:
        self._blocks.append(kind)

    def leave(self) -> None:
        self._blocks.pop()


def block_kind(name: str) -> str | None:
    for prefix, kind in BLOCK_KINDS:
        if name.startswith(prefix):
            return kind
    return None


def count_step_ops(model: nn.Module, step: Callable[[], None]) -> dict:
    """Run ``step`` once under ``StepOpCounter`` -> {"ops_per_step", "casts_per_step", "parameter_casts_per_step",
    "ops_per_block": {kind: forward ops per block call}, "block_calls": {kind: calls}}."""
    from mplug_pretrain.train.block_compile import transformer_blocks
    storages = {_storage(p) for p in model.parameters()}
    counter = StepOpCounter(storages)
    calls: Counter = Counter()
    handles = []
    for name, block in transformer_blocks(model):
        kind = block_kind(name) or "other_block"

        def pre(_module, _args, kind=kind):
            calls[kind] += 1
            counter.enter(kind)

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(lambda *_: counter.leave()))
    try:
        with counter:
            step()
    finally:
        for handle in handles:
            handle.remove()
    per_block = defaultdict(float)
    for kind, n in calls.items():
        per_block[kind] = counter.block_ops[kind] / n
    return {"ops_per_step": counter.ops, "casts_per_step": counter.casts,
            "parameter_casts_per_step": counter.parameter_casts, "ops_per_block": dict(per_block),
            "block_calls": dict(calls)}
