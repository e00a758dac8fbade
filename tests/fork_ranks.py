"""Test harness: a rank script (or ``-c CODE``) on N ranks forked from one process that first imported what a rank
imports (``mplug_pretrain.utils.fork_launch``, as ``mplug pretrain --nproc N`` does without a GPU), in place of
``torch.distributed.run``'s N fresh interpreters and its own (~10-15 CPU-s each on this machine). Each rank gets
torchrun's RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.

    python tests/fork_ranks.py N [--preload MODULE,...] SCRIPT [ARGS...]
    python tests/fork_ranks.py N [--preload MODULE,...] -c CODE [ARGS...]

``--preload``: import these modules before the fork instead of everything a pretraining rank imports (a worker
that needs only torch.distributed and a head saves ~8 CPU-s of DeepSpeed, dynamo and the tokenizer).
"""
import os
import runpy
import sys


def main(argv: list[str]) -> int:
    nproc, target = int(argv[0]), argv[1:]
    from mplug_pretrain.train.distributed import free_port
    from mplug_pretrain.utils.fork_launch import PRELOAD, fork_ranks, prepare_fork
    preload = PRELOAD
    if target[0] == "--preload":
        preload, target = tuple(target[1].split(",")), target[2:]
    reason = prepare_fork(preload)
    if reason is not None:
        print(f"fork_ranks: cannot fork the ranks here: {reason}", file=sys.stderr)
        return 2

    def rank_main() -> int:
        if target[0] == "-c":
            sys.argv = ["-c", *target[2:]]
            exec(compile(target[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 -- python -c
        else:
            sys.argv = list(target)
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
            runpy.run_path(target[0], run_name="__main__")
        return 0
    return fork_ranks(nproc, rank_main, free_port())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
