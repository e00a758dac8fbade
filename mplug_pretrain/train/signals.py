"""SIGTERM / SIGUSR1 -> save a checkpoint at the next step boundary, then exit cleanly.

Slurm sends USR1 before preemption (``--signal=B:USR1@T``, forwarded by the batch script) and TERM on
cancel; the handler only sets a flag, the training loop agrees on it across ranks and saves. Rank 0 then
writes ``<run_dir>/preempted`` (``PREEMPTED_MARKER``), which tells the sbatch script (slurm/script.py) to
requeue the job.

``scancel`` and Slurm's time limit signal the whole process group: the DataLoader workers ignore these signals
(``data/reading/loader.py``, ``leave_stop_signals_to_main``), so only the main process acts on them. The ranks of
``mplug pretrain --nproc N`` get SIGTERM from the kernel when their launcher dies (``cli/commands/pretrain.py``).
"""
from __future__ import annotations

import signal

PREEMPTED_MARKER = "preempted"


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None

    def install(self) -> StopRequest:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None
