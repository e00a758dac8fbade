"""The launcher of ``mplug pretrain --nproc N``: torchrun (``torch.distributed.run``, in this process) with the stop
signals passed to the ranks instead of ending the launcher.

torchrun's own handler turns SIGTERM into a ``SignalException``: it gives the ranks 30 s, then exits 1 with a
30-line traceback, although the ranks saved and stopped as asked; and it leaves SIGUSR1 (Slurm's warning before
preemption) at its default action, which kills torchrun (exit -10). Here both go to the ranks (the processes of
this one whose command runs mplug_pretrain), which save at their next step and exit 0 (train/signals.py);
torchrun then sees every rank succeed and exits 0, as a single-process run does. A signal that arrives before the
ranks exist ends the launcher as the signal would. A rank that fails makes the launcher exit with that rank's
code (2 config, 3 data, 5 another rank ...), without torchrun's traceback.

    python -m mplug_pretrain.cli.torchrun_launch <torchrun arguments>
"""
from __future__ import annotations

import logging
import os
import signal
import sys

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)


def rank_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent`` and whose command runs mplug_pretrain (read from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"mplug_pretrain" in f.read():
                    pids.append(int(entry))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return pids


def _forward(signum, frame) -> None:
    ranks = rank_pids(os.getpid())
    if not ranks:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    for pid in ranks:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    print(f"[launcher] {signal.Signals(signum).name} passed to the {len(ranks)} rank(s): each saves a checkpoint at "
          "its next step and exits", file=sys.stderr, flush=True)


def exit_code(failures: dict) -> int:
    """The exit code of the launcher when ranks failed (``{global rank: ProcessFailure}``): the code of the first
    rank that exited with an error (2 config, 3 data, ... as a single process gives it), else 128 + N for the
    first one killed by signal N (torchrun stops the other ranks with SIGTERM once one failed)."""
    from mplug_pretrain.utils.fork_launch import launcher_exit_code
    ordered = sorted(failures, key=lambda r: (failures[r].timestamp, r))
    return launcher_exit_code([int(failures[r].exitcode) for r in ordered])


def main(argv: list[str]) -> int:
    for sig in FORWARDED:
        signal.signal(sig, _forward)
    # torchrun's own report of a failed rank is a log line per rank and a traceback of its launcher: the rank's
    # `mplug:` line above already says what is wrong, and the line below which rank it was
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    try:
        torchrun(["--signals_to_handle", "SIGINT,SIGHUP,SIGQUIT", *argv])  # SIGTERM stays ours (above)
    except ChildFailedError as err:
        code = exit_code(err.failures)
        ranks = ", ".join(str(rank) for rank in sorted(err.failures))
        print(f"[launcher] rank(s) {ranks} failed (exit {code}); the error is printed above", file=sys.stderr,
              flush=True)
        return code
    return 0


if __name__ == "__main__":
    from mplug_pretrain.utils.fast_exit import exit_now
    exit_now(main(sys.argv[1:]))
