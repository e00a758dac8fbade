"""The one contract between the training engine (train/) and a trained model: what the engine does to the model
around each optimizer step. The engine never reaches into a model's private names; a model states here what it
needs, and the engine carries it out on the fp32 masters, knowing how ZeRO shards them.

- ``defer_enqueue``: set by the engine; a forward then keeps its momentum features pending until
  ``commit_enqueue()``, called once the step's loss is known finite on every rank (the momentum features of a
  deferred forward enter the ITC queues); ``discard_enqueue()`` when the step is skipped.
- ``momentum_pairs()`` and ``momentum``: (online, momentum copy) module pairs and the EMA coefficient m; after each
  optimizer step the engine sets theta_m <- m * theta_m + (1 - m) * theta for every pair.
- ``clamped_parameters()``: (parameter, low, high) that must stay in range (the ITC temperature); the engine
  clamps them after each optimizer step, on the master and on the module's copy.

The defaults describe a model that needs none of it.
"""
from __future__ import annotations

from torch import nn


class StepHooks:
    """Mixin for an ``nn.Module`` trained by train/loop.py: no momentum, nothing clamped, no queue."""

    momentum: float = 0.0
    defer_enqueue: bool = False

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return []

    def clamped_parameters(self) -> list[tuple[nn.Parameter, float, float]]:
        return []

    def commit_enqueue(self) -> None:
        pass

    def discard_enqueue(self) -> None:
        pass
