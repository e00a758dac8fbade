"""``die_with_parent``: the kernel signals this process when its parent exits (Linux ``prctl(PR_SET_PDEATHSIG)``).

Used where a parent may be killed without a chance to clean up (``kill -9``, the OOM killer): the ranks that
``mplug pretrain --nproc N`` starts (forked, or through torchrun: each rank in a session of its own, so a signal
to the launcher's process group never reaches them) and the DataLoader workers of every rank. Elsewhere
(macOS) it does nothing and says so by returning False.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM, expected_parent: int | None = None) -> bool:
    """Ask for ``sig`` when the parent exits. ``expected_parent``: the pid the parent must have; if it is
    already gone (it died before this call, and this process was re-parented), ``sig`` is raised at once."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True
