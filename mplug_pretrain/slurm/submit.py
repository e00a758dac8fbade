"""`mplug submit pretrain|finetune|eval`: validate the run config, render an sbatch script into
``<run_dir>/submit/<kind>.sbatch`` and submit it with ``sbatch`` (or print it with ``--dry-run``).

    mplug submit pretrain --nodes 4 --gpus-per-node 8 --time 24:00:00 --partition gpu \\
        --config configs/pretrain_base.yaml distributed.precision=bf16 distributed.zero_stage=2
    mplug submit eval caption,retrieval --nodes 1 --time 02:00:00 --config FILE \\
        --checkpoint runs/a/model runs/b/model eval.batch_size=64

Environment: ``--setup LINE`` (repeatable) runs shell lines before ``srun`` (``module load``, activating a
venv or conda environment), then each task runs ``python -m mplug_pretrain`` from the PATH they leave. Without
``--setup`` the tasks run this machine's python (``sys.executable``: a venv shared with the compute nodes).
``--cpus-per-task`` defaults to the config's loader workers + 2 (a warning when set lower: Slurm's default is
one CPU per task); ``--mem`` and ``--sbatch-arg --qos=high`` (repeatable) go into ``#SBATCH`` lines.

Eval submits a job array: one array task per (task, checkpoint) pair, in that order, each writing
``<run_dir>/eval/<index>-<task>-<checkpoint label>.json`` (passed to ``mplug eval`` as ``--out``), the label
naming the checkpoint's run and step (``checkpoint_label``). ``key=value`` words after ``--checkpoint``
that are not existing paths are overrides, not checkpoints.
The script layout and the preemption protocol are described in :mod:`mplug_pretrain.slurm.script`.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Collection

from mplug_pretrain.config_loader import find_config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.slurm.script import (
    SlurmJob,
    check_sbatch_value,
    default_signal_seconds,
)
from mplug_pretrain.tasks.evaluation import checkpoint_label
from mplug_pretrain.utils.atomic_files import write_text_atomic

log = logging.getLogger(__name__)


def split_checkpoint_overrides(args: argparse.Namespace) -> None:
    """``--checkpoint A B eval.x=y``: argparse hands ``eval.x=y`` to ``--checkpoint``; move every word that
    holds '=' and is not an existing path to ``args.overrides`` (after the ones given before)."""
    checkpoints, overrides = [], []
    for word in args.checkpoint:
        (overrides if "=" in word and not os.path.exists(word) else checkpoints).append(word)
    if not checkpoints:
        raise ConfigError("--checkpoint: no model folder given (only key=value overrides followed it)")
    args.checkpoint, args.overrides = checkpoints, [*args.overrides, *overrides]


def build_job(kind: str, args: argparse.Namespace, eval_tasks: Collection[str] = ()) -> SlurmJob:
    """Validates the config (with its overrides) and the options; returns the job to render. ``eval_tasks``:
    the task names ``mplug eval`` offers (an eval job's tasks must be among them)."""
    from mplug_pretrain.config import load_config
    from mplug_pretrain.config_loader import refuse_expanded_brace_ranges

    if kind == "eval":
        split_checkpoint_overrides(args)
        refuse_expanded_brace_ranges(args.overrides)  # again (cli/exit_codes.py checked): with the words it moved
    # an eval job reads only what `mplug eval` reads: the training shards need not exist where it runs
    cfg = load_config(args.config, args.overrides, check_paths="eval" if kind == "eval" else True)
    if kind == "pretrain":
        from mplug_pretrain.tasks.pretrain.train import random_init_problem
        problem = random_init_problem(cfg)
        if problem:
            raise ConfigError(problem)
    run_dir = os.path.abspath(cfg.run_dir)
    config = os.path.abspath(find_config(args.config))  # a shipped config by name: its path in the package
    setup = tuple(getattr(args, "setup", None) or ())
    python = args.python or ("python" if setup else sys.executable)
    if os.sep in python:
        python = os.path.abspath(python)  # not realpath: a venv's python is a symlink that must stay one
    program = (python, "-m", "mplug_pretrain")
    overrides = tuple(args.overrides)
    if kind == "pretrain":
        commands = [(*program, "pretrain", "--config", config, "--resume", "auto", *overrides)]
    elif kind == "finetune":
        commands = [(*program, "finetune", args.task, "--config", config, "--resume", "auto", *overrides)]
    else:
        commands = _eval_commands(program, config, run_dir, args, overrides, eval_tasks, cfg)
    job_name = args.job_name or check_sbatch_value(
        f"{cfg.run.name}-{kind}", "run.name (the default --job-name)"
    )
    signal_seconds = default_signal_seconds(args.time) if args.signal_seconds is None else args.signal_seconds
    return SlurmJob(
        kind=kind,
        job_name=job_name,
        nodes=str(args.nodes),
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        workdir=os.getcwd(),
        run_dir=run_dir,
        commands=tuple(commands),
        signal_seconds=signal_seconds,
        partition=args.partition,
        account=args.account,
        cpus_per_task=cpus_per_task(cfg, kind, args.cpus_per_task),
        array=getattr(args, "array", None),
        mem=getattr(args, "mem", None),
        setup=setup,
        sbatch_args=tuple(getattr(args, "sbatch_arg", None) or ()),
    )


def cpus_per_task(cfg, kind: str, given: int | None) -> int:
    """``given``, or the loader workers + 2 (the training process and one spare); warns when ``given`` is lower."""
    workers = cfg.data.num_workers if kind != "eval" else max(cfg.data.num_workers, cfg.eval.num_workers)
    wanted = workers + 2
    if given is None:
        return wanted
    if given < wanted:
        log.warning("--cpus-per-task %d is below the %d loader worker(s) + 2 the config asks for "
                    "(data.num_workers / eval.num_workers): the workers will share %d CPU(s); pass "
                    "--cpus-per-task %d or lower the workers", given, workers, given, wanted)
    return given


def check_every_evaluation(cfg, tasks: list[str], checkpoints: list[str]) -> None:
    """Each (task, checkpoint) the array would run, checked as ``mplug eval`` checks it before loading: every
    problem is listed in one ConfigError, so nothing is submitted that would fail on the cluster."""
    from mplug_pretrain.tasks.eval_inputs import check_eval_inputs
    problems = []
    for task in tasks:
        for checkpoint in checkpoints:
            try:
                check_eval_inputs(task, cfg, checkpoint)
            except ConfigError as err:
                if str(err) not in problems:
                    problems.append(str(err))
    if problems:
        raise ConfigError("submit eval: nothing submitted:\n  " + "\n  ".join(problems))


def _eval_commands(
    program: tuple[str, ...], config: str, run_dir: str, args: argparse.Namespace, overrides: tuple[str, ...],
    eval_tasks: Collection[str], cfg,
) -> list[tuple[str, ...]]:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in eval_tasks]
    if not tasks or unknown:
        raise ConfigError(
            f"tasks: expected a comma-separated subset of {','.join(sorted(eval_tasks))}, got {args.tasks!r}"
        )
    checkpoints = [os.path.abspath(c) for c in args.checkpoint]
    for given, path in zip(args.checkpoint, checkpoints):
        if not os.path.exists(path):
            raise ConfigError(f"--checkpoint: {given!r} does not exist")
    check_every_evaluation(cfg, tasks, checkpoints)
    commands = []
    for task in tasks:
        for checkpoint in checkpoints:
            out = f"{run_dir}/eval/{len(commands)}-{task}-{checkpoint_label(checkpoint)}.json"
            argv = ("eval", task, "--config", config, "--checkpoint", checkpoint, "--out", out)
            commands.append((*program, *argv, *overrides))
    return commands


def submit_script(job: SlurmJob, script: str) -> str:
    """Writes the script into the run folder, runs ``sbatch`` and returns the job id."""
    write_text_atomic(job.script_path, script)
    try:
        result = subprocess.run(
            ["sbatch", "--parsable", job.script_path],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except FileNotFoundError as err:
        raise RuntimeError(
            "sbatch not found: install Slurm's client or run on a login node "
            "(slurm/local_cluster.sh starts a local cluster)"
        ) from err
    if result.returncode != 0:
        raise RuntimeError(f"sbatch {job.script_path} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip().split(";")[0]
