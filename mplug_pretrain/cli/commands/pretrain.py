"""``mplug pretrain --config FILE [--resume latest|auto|TAG] [--nproc N] [key=value ...]``."""
from __future__ import annotations

import subprocess
import sys

from mplug_pretrain.cli.parsing import add_config_args, load_config_from_args


def register(sub) -> None:
    p = sub.add_parser("pretrain", help="pretrain on WebDataset shards (DeepSpeed ZeRO)")
    add_config_args(p)
    p.add_argument("--resume", default=None, help="latest | auto (latest if present) | a checkpoint tag")
    p.add_argument("--nproc", type=int, default=0, help="ranks on this machine (relaunches under torchrun)")
    p.set_defaults(func=run)


def run(args) -> int:
    import os
    cfg = load_config_from_args(args)  # validate before anything starts, also before a relaunch
    if args.nproc and args.nproc > 1 and "RANK" not in os.environ:
        return _relaunch_with_torchrun(args.nproc)
    from mplug_pretrain.train.distributed import shutdown_distributed
    from mplug_pretrain.train.pretrain import run_pretrain
    try:
        run_pretrain(cfg, resume=args.resume)  # a preempted run saved and exits 0; Slurm requeues it
    finally:
        shutdown_distributed()
    return 0


def _relaunch_with_torchrun(nproc: int) -> int:
    """``--nproc N`` on one machine: re-run this very command under torchrun with N ranks."""
    from mplug_pretrain.train.distributed import free_port
    argv = list(sys.argv[1:])
    i = argv.index("--nproc")
    del argv[i:i + 2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), "-m", "mplug_pretrain", *argv]
    return subprocess.call(cmd)
