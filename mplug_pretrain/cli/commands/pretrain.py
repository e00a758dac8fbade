"""``mplug pretrain --config FILE [--resume latest|auto|TAG] [--nproc N] [key=value ...]``."""
from __future__ import annotations

import os
import signal
import sys

from mplug_pretrain.cli.parsing import add_config_args, load_config_from_args
from mplug_pretrain.errors import ConfigError

LAUNCHER_PID = "MPLUG_LAUNCHER_PID"  # set for the ranks of `--nproc N`: the launcher process they must die with


def register(sub) -> None:
    p = sub.add_parser("pretrain", help="pretrain on WebDataset shards (DeepSpeed ZeRO)")
    add_config_args(p)
    p.add_argument("--resume", default=None, help="latest | auto (latest if present) | a checkpoint tag")
    p.add_argument("--nproc", type=int, default=0, help="ranks on this machine (becomes torchrun with N ranks)")
    p.set_defaults(func=run)


def run(args) -> int:
    cfg = load_config_from_args(args)  # validate before anything starts, also before a relaunch
    if args.nproc and args.nproc > 1:
        refuse_inherited_world(args.nproc)
        if "RANK" not in os.environ:
            return _start_ranks(args, cfg.distributed.rank_start)
    if os.environ.get(LAUNCHER_PID):
        from mplug_pretrain.utils.parent_death import die_with_parent
        # the launcher starts each rank in a session of its own: killed with -9, it would leave them training
        # (orphans beside a later --resume). SIGTERM: the rank saves at its next step and exits (train/signals.py).
        die_with_parent(signal.SIGTERM, expected_parent=int(os.environ[LAUNCHER_PID]))
    from mplug_pretrain.tasks.pretrain.train import run_pretrain
    from mplug_pretrain.train.distributed import shutdown_distributed
    try:
        run_pretrain(cfg, resume=args.resume)  # a preempted run saved and exits 0; Slurm requeues it
    finally:
        shutdown_distributed()
    return 0


def _start_ranks(args, rank_start: str) -> int:
    """``--nproc N`` on one machine: N ranks forked from this process (utils/fork_launch.py), or, with a GPU or
    ``distributed.rank_start=exec``, this process becomes torchrun (does not return)."""
    from mplug_pretrain.train.distributed import free_port
    from mplug_pretrain.utils import fork_launch
    reason = "distributed.rank_start=exec" if rank_start == "exec" else fork_launch.prepare_fork()
    if reason is None:
        from mplug_pretrain.cli.exit_codes import run_command
        return fork_launch.fork_ranks(args.nproc, lambda: run_command(args), free_port())
    if rank_start == "fork":
        raise ConfigError(f"distributed.rank_start=fork: the ranks cannot be forked here ({reason}); use auto or "
                          "exec")
    _exec_torchrun(args.nproc)
    return 1  # not reached: _exec_torchrun replaces this process


def refuse_inherited_world(nproc: int) -> None:
    """``--nproc N`` in a process whose environment already names a rank and a world of another size (a shell that
    exported a launcher's RANK / WORLD_SIZE, or a process that ran a training in-process): the run would silently
    be that world's rank instead of starting N ranks. Under a launcher that already started N ranks, --nproc N is
    redundant and the process runs as its rank."""
    if "RANK" not in os.environ or os.environ.get(LAUNCHER_PID):
        return
    world = os.environ.get("WORLD_SIZE")
    if world != str(nproc):
        raise ConfigError(
            f"--nproc {nproc}: the environment already has RANK={os.environ['RANK']} WORLD_SIZE={world} (exported by "
            "a launcher, or left over in this shell), which would make this process one rank of that world instead "
            f"of starting {nproc}. Unset RANK WORLD_SIZE LOCAL_RANK to start {nproc} ranks here, or drop --nproc when "
            "a launcher (torchrun, srun, mpirun) starts the ranks")


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _exec_torchrun(nproc: int) -> None:
    """``--nproc N`` with fresh interpreters: this process becomes torchrun (``os.execv``, same pid; cli/torchrun_launch.py)
    running this very command with N ranks. A SIGTERM / SIGUSR1 to the ``mplug`` pid is passed to the ranks, which
    save and exit 0; if it is killed outright, each rank gets SIGTERM from the kernel (``LAUNCHER_PID``)."""
    from mplug_pretrain.train.distributed import free_port
    cmd = [sys.executable, "-m", "mplug_pretrain.cli.torchrun_launch", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), "-m", "mplug_pretrain", *_without_nproc(sys.argv[1:])]
    os.environ[LAUNCHER_PID] = str(os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
