"""``mplug submit pretrain|finetune|eval ...``: the parser; slurm/submit.py builds the job and submits it.
Task names come from the one registry (cli/registry.py), so every registered task can be submitted."""
from __future__ import annotations

import argparse
import sys

from mplug_pretrain.cli.parsing import IntermixedParser
from mplug_pretrain.cli.registry import EVAL_TASKS, FINETUNE_TASKS
from mplug_pretrain.slurm.script import KINDS


def register(subparsers) -> None:
    """Registers ``submit`` with one sub-command per job kind on the ``mplug`` parser."""
    parser = subparsers.add_parser("submit", help="render an sbatch script into the run folder and submit it")
    kinds = parser.add_subparsers(
        dest="submit_kind", required=True, metavar="pretrain|finetune|eval", parser_class=IntermixedParser
    )
    helps = {
        "pretrain": "multi-node pretraining (requeued with resume on preemption)",
        "finetune": "fine-tuning: " + " | ".join(sorted(FINETUNE_TASKS)),
        "eval": "a job array: one evaluation per (task, checkpoint)",
    }
    for kind in KINDS:
        p = kinds.add_parser(kind, help=helps[kind])
        if kind == "finetune":
            p.add_argument("task", choices=sorted(FINETUNE_TASKS))
        if kind == "eval":
            p.add_argument("tasks", help="evaluation task(s), comma-separated: " + ",".join(sorted(EVAL_TASKS)))
            p.add_argument(
                "--checkpoint",
                nargs="+",
                action="extend",
                required=True,
                metavar="DIR",
                help="model folder(s); key=value words after them (not existing paths) are config overrides",
            )
            p.add_argument("--array", default=None, help="a subset of the array indices, e.g. 0-3%%2")
        _add_job_options(p)
        p.set_defaults(func=run, submit_kind=kind)


def _add_job_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config (configs/*.yaml)")
    p.add_argument("--nodes", default="1", metavar="N|MIN-MAX",
                   help="nodes, or a range: the job starts on as many as Slurm can give, and a requeue that gets "
                   "another count resumes the run on it (the checkpoint is re-split over the new ranks)")
    p.add_argument(
        "--gpus-per-node", type=int, default=0, help="one task per GPU; 0 = one CPU process per node"
    )
    p.add_argument("--time", required=True, help="time limit, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument(
        "--cpus-per-task", type=int, default=None,
        help="CPUs per task (default: the config's loader workers + 2; a warning when lower)",
    )
    p.add_argument("--mem", default=None, help="memory per node, e.g. 64G (sbatch --mem; 0 = all of it)")
    p.add_argument(
        "--setup", action="append", default=[], metavar="LINE",
        help="a shell line run before srun, e.g. 'module load cuda/12.4' or 'source ~/venv/bin/activate' "
        "(repeatable); the tasks then run `python -m mplug_pretrain` from the PATH it leaves",
    )
    p.add_argument(
        "--sbatch-arg", action="append", default=[], metavar="--NAME[=VALUE]",
        help="another #SBATCH option, e.g. --sbatch-arg=--qos=high --sbatch-arg=--exclusive (repeatable)",
    )
    p.add_argument("--job-name", default=None, help="default: <run.name>-<kind>")
    p.add_argument(
        "--signal-seconds",
        type=int,
        default=None,
        help="USR1 this many seconds before the time limit: checkpoint, requeue, resume "
        "(default 300, or a tenth of a shorter limit)",
    )
    p.add_argument(
        "--python", default=None,
        help="python that runs the job (default: `python` after --setup, else this machine's python)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, passed on verbatim")


def run(args: argparse.Namespace) -> int:
    from mplug_pretrain.slurm.script import render_script
    from mplug_pretrain.slurm.submit import build_job, submit_script
    job = build_job(args.submit_kind, args, eval_tasks=EVAL_TASKS)
    script = render_script(job)
    if args.dry_run:
        print(script, end="")
        return 0
    try:
        job_id = submit_script(job, script)
    except RuntimeError as err:
        print(f"mplug submit: {err}", file=sys.stderr)
        return 1
    print(job_id)
    print(f"script {job.script_path}\nlog    {job.log_pattern}", file=sys.stderr)
    return 0
