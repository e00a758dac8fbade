"""The ranks of ``mplug pretrain --nproc N`` on a machine without a GPU: forked from the ``mplug`` process after it
imported what every rank needs, instead of N fresh interpreters under torchrun (cli/torchrun_launch.py).

A fresh rank spends about 9 CPU-s importing torch, torch._dynamo (which torch.optim pulls in), DeepSpeed, the
tokenizer and the model before its first step; forked ranks share the launcher's imports, so a 2-rank run starts
that much sooner and the launcher is no longer a second interpreter. What a rank does after the fork is what it
does under torchrun: the same environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), a session
of its own, SIGTERM from the kernel if the launcher dies, the same exit codes.

Forking is for CPU runs only: CUDA does not survive a fork once the parent has asked for its devices (DeepSpeed's
import does), so with a GPU the ranks start as fresh interpreters (``distributed.rank_start``). The launcher
does no computation before it forks (an OpenMP thread pool would not survive the fork either).

Signals: SIGTERM / SIGUSR1 to the launcher go to the ranks, which save at their next step and exit 0; Ctrl-C goes
to them as SIGTERM, a second Ctrl-C as SIGKILL. When a rank fails, the others get SIGTERM, then SIGKILL after ``STOP_GRACE_SECONDS``, and the
launcher exits with the failing rank's own code (2 config, 3 data, 5 another rank ...; 128 + N if killed by N).
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOP_GRACE_SECONDS = 30.0
# what a pretraining rank imports that the launcher has not yet, paid once here instead of in each rank: torch's
# optimizers import torch._dynamo; ZeRO 1-3 import DeepSpeed's Muon optimizer (to check the client optimizer's type),
# whose torch.compile decorators import torch._inductor (~5 CPU-s)
PRELOAD = ("torch._dynamo", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "mplug_pretrain.data.tokenizer",
           "webdataset",
           "mplug_pretrain.models.mplug", "mplug_pretrain.tasks.pretrain.train", "mplug_pretrain.train.engine",
           "mplug_pretrain.data.reading.pipeline")


def prepare_fork(preload: tuple[str, ...] = PRELOAD) -> str | None:
    """Import what a rank needs (``preload``) when the ranks can be forked from this process. -> why they cannot
    (not Linux; a CUDA device, asked through NVML, which leaves CUDA usable in forked children; threads already
    running here), or None."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch
    if torch.cuda.is_available():
        return "a CUDA device is visible"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as a rank sets it without a GPU (train/distributed.py)
    for module in preload:
        importlib.import_module(module)
    threads = len(os.listdir("/proc/self/task"))
    return f"{threads} threads run in the launcher" if threads > 1 else None


def fork_ranks(nproc: int, rank_main: Callable[[], int], master_port: int) -> int:
    """Run ``rank_main`` in ``nproc`` forked ranks and wait for them. -> the launcher's exit code. In the ranks
    this never returns: each ends (``utils.fast_exit.exit_now``) with ``rank_main``'s code."""
    launcher = os.getpid()
    common = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(master_port), "MPLUG_LAUNCHER_PID": str(launcher)}
    sys.stdout.flush()
    sys.stderr.flush()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # a signal now waits for the handlers below
    ranks: dict[int, int] = {}  # pid -> rank
    interrupted: list[int] = []  # the SIGINTs received so far
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _become_rank(rank, common, old_mask, rank_main)
        ranks[pid] = rank
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: _forward(signum, ranks, interrupted))
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    try:
        return _wait(ranks)
    finally:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)


def _become_rank(rank: int, common: dict, mask, rank_main: Callable[[], int]) -> None:
    def start() -> int:
        os.setsid()  # as torchrun does: a signal to the launcher's process group reaches the launcher only
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        os.environ.update(common, RANK=str(rank), LOCAL_RANK=str(rank))
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return rank_main()
    run_then_exit(start)


def run_then_exit(main: Callable[[], int]) -> None:
    """End a forked process as a fresh ``python -m mplug_pretrain`` would: ``main``'s code, a ``SystemExit``'s
    code, or a printed traceback and 1 (``utils.fast_exit.exit_now``: no return to the parent's code)."""
    from mplug_pretrain.utils.fast_exit import exit_now
    code = 1
    try:
        code = main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 -- printed as a fresh interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    finally:
        exit_now(code)


def launcher_exit_code(codes: list[int]) -> int:
    """The launcher's exit code from the failed ranks' codes, earliest first: the first rank's own error code
    (2 config, 3 data, ... as a single process gives it), else 128 + N for the first one killed by signal N (the
    others were stopped by the launcher once one failed)."""
    code = next((c for c in codes if c > 0), codes[0])
    return 128 - code if code < 0 else code


def _forward(signum: int, ranks: dict[int, int], interrupted: list[int]) -> None:
    """SIGTERM / SIGUSR1 as they are; Ctrl-C (SIGINT) as SIGTERM, a second one as SIGKILL."""
    sent, as_sent = signum, ""
    if signum == signal.SIGINT:
        interrupted.append(signum)
        sent = signal.SIGTERM if len(interrupted) == 1 else signal.SIGKILL
        as_sent = f" as {signal.Signals(sent).name}"
    _signal_all(ranks, sent)
    then = "killed" if sent == signal.SIGKILL else "each saves a checkpoint at its next step and exits"
    print(f"[launcher] {signal.Signals(signum).name} passed to the {len(ranks)} rank(s){as_sent}: {then}",
          file=sys.stderr, flush=True)


def _wait(ranks: dict[int, int]) -> int:
    """Reap the ranks; after the first failure stop the others (SIGTERM, then SIGKILL after
    ``STOP_GRACE_SECONDS``). -> 0, or ``launcher_exit_code`` of the failed ranks."""
    failed: list[tuple[int, int]] = []  # (rank, exit code) in the order they ended
    kill_at = None
    while ranks:
        pid, status = os.waitpid(-1, 0 if kill_at is None else os.WNOHANG)
        if pid == 0:  # waiting out the grace period
            if time.monotonic() > kill_at:
                _signal_all(ranks, signal.SIGKILL)
                kill_at = None
            time.sleep(0.05)
            continue
        rank = ranks.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if rank is None or code == 0:
            continue
        failed.append((rank, code))
        if len(failed) == 1:
            _signal_all(ranks, signal.SIGTERM)
            kill_at = time.monotonic() + STOP_GRACE_SECONDS
    if not failed:
        return 0
    code = launcher_exit_code([c for _, c in failed])
    print(f"[launcher] rank(s) {', '.join(str(r) for r, _ in sorted(failed))} failed (exit {code}); the error is "
          "printed above", file=sys.stderr, flush=True)
    return code


def _signal_all(ranks: dict[int, int], sig: int) -> None:
    for pid in ranks:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
