"""Count the operations that make the host wait for the device (a "host sync" on CUDA), on any device.

``HostSyncCounter`` is a ``TorchDispatchMode``: inside it every aten op is seen once (ops that an op runs
internally are not re-dispatched to the mode), so on the CPU it counts exactly the calls that on a GPU would
block the host: reading a scalar (``_local_scalar_dense``: ``.item()``, ``bool()``, ``int()``, ``float()``),
``nonzero`` (``torch.where(cond)``), ``is_nonzero`` and ``item``; and the ops that call one of these inside
(boolean-mask indexing and assignment, ``masked_select``, ``multinomial``'s checks, ``repeat_interleave``
without ``output_size``), each counted once under its own name. ``Tensor.tolist()`` reads a CPU tensor without
dispatching an op; ``count_tolist=True`` counts its calls too (on a GPU each is a sync), by wrapping the method
while the counter is active.
"""
from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("_local_scalar_dense", "nonzero", "is_nonzero", "item")
# ops that sync inside, where the mode only sees the outer op: boolean-mask indexing and assignment (nonzero),
# masked_select, multinomial (its distribution checks), repeat_interleave without output_size
INNER_SYNC_OPS = ("masked_select", "multinomial")
BOOL_INDEX_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as c: ...`` -> ``c.total``, ``c.by_op`` ({op name: calls}) and ``c.by_source``
    ({"deepspeed" | "ours": calls}: whose code asked, by the innermost calling frame outside torch)."""

    def __init__(self, stack_depth: int = 0, count_tolist: bool = False):
        super().__init__()
        self.count_tolist = count_tolist
        self._tolist = None
        self.by_op: Counter = Counter()
        self.by_source: Counter = Counter()
        self.stack_depth = stack_depth  # > 0: also remember where each sync came from (debugging)
        self.sites: Counter = Counter()

    def __enter__(self):
        if self.count_tolist:
            self._tolist = original = torch.Tensor.tolist
            counter = self

            def tolist(tensor):
                counter._count("tolist")
                return original(tensor)
            torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        if self._tolist is not None:
            torch.Tensor.tolist, self._tolist = self._tolist, None
        return super().__exit__(*exc)

    def _count(self, name: str) -> None:
        self.by_op[name] += 1
        frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
        self.by_source["deepspeed" if frames and "/deepspeed/" in frames[-1].filename else "ours"] += 1
        if self.stack_depth:
            self.sites["; ".join(f"{f.filename.split('site-packages/')[-1].split('mplug_pretrain/')[-1]}:"
                                 f"{f.lineno}" for f in frames[-self.stack_depth:])] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and func is not \
                torch.ops.aten.repeat_interleave.self_int:
            name = "repeat_interleave (nonzero inside)"
        elif name in BOOL_INDEX_OPS and any(t is not None and t.dtype in (torch.bool, torch.uint8)
                                            for t in (args[1] if len(args) > 1 else ())):
            name = f"{name} (boolean mask: nonzero inside)"
        elif name in INNER_SYNC_OPS:
            name = f"{name} (sync inside)"
        elif name not in SYNC_OPS:
            name = None
        if name is not None:
            self._count(name)
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())





def check_on_device(condition: torch.Tensor, message: str) -> None:
    """Raise ValueError(message) unless the bool tensor ``condition`` holds, without a host sync on an
    accelerator (there a failed check is a device-side assert that fails the run at its next sync)."""
    try:
        torch._assert_async(condition, message)
    except RuntimeError as err:  # raised at once on the CPU
        raise ValueError(message) from err


def host_any(flags: torch.Tensor) -> bool:
    """``flags.any()`` of a bool tensor; one on the CPU is read in place (host memory: no device involved, and
    nothing for ``HostSyncCounter`` to count), one on a device with ``bool()`` (a sync)."""
    if flags.device.type == "cpu":
        return bool(flags.detach().numpy().any())
    return bool(flags.any())
