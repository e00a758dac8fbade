"""The sbatch script that `mplug submit` writes: one template for pretraining, fine-tuning and
evaluation arrays, rendered from a :class:`SlurmJob`.

Process layout: one ``srun`` task per GPU (one per node when ``gpus_per_node == 0``, i.e. on CPU).
Each task reads its rank from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID
(:mod:`mplug_pretrain.train.distributed`); the script exports the rendezvous point
``MASTER_ADDR`` = first node of the allocation and ``MASTER_PORT = 20000 + SLURM_JOB_ID % 20000``
(jobs sharing a host get different ports; array tasks have their own job ids), or a port the kernel picks when
another program already listens on that one on the first node.

Preemption: ``--signal=B:USR1@S`` makes Slurm signal the batch shell S seconds before the time
limit. The shell forwards USR1 to ``srun``, which forwards it to every task. Training tasks save a
checkpoint, rank 0 writes ``<run_dir>/preempted`` and they exit 0; seeing that marker, the shell
runs ``scontrol requeue`` and the next start continues from the latest checkpoint
(``--resume auto``). Evaluation has nothing to save: a signalled array task is requeued and
evaluates again from the start.

Environment: ``setup`` lines (``module load cuda/12.4``, ``source ~/venvs/mplug/bin/activate``) run in the
batch shell before ``srun``, so every task inherits what they set; the command is then ``python -m
mplug_pretrain`` as found on the PATH they leave (the submitting machine's venv python only when no setup is
given). They run with ``set -u`` off (module and conda scripts read unset variables) and stop the job on error.

Everything a user typed reaches bash through :func:`shlex.quote` (one word, never expanded), except the
setup lines, which are shell by intent; values that must go into ``#SBATCH`` lines (not parsed by bash) are
restricted to safe characters.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.train.signals import PREEMPTED_MARKER

KINDS = ("pretrain", "finetune", "eval")
MAX_SIGNAL_SECONDS = 65535  # sbatch --signal limit

_SAFE_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.,:/+@=-]+$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)$")
_ARRAY_ITEM = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+))?)?$")
_MEM = re.compile(r"^\d+[KMGT]?$")
_NODES = re.compile(r"^(\d+)(?:-(\d+))?$")
_SBATCH_ARG = re.compile(r"^--([a-z][a-z0-9-]*)(?:=(.+))?$")
# options the script sets itself (or that would break it): a pass-through may not repeat them
_OWN_OPTIONS = frozenset({
    "job-name", "nodes", "ntasks-per-node", "ntasks", "gpus-per-node", "cpus-per-task", "mem", "time",
    "partition", "account", "array", "chdir", "output", "error", "open-mode", "signal", "requeue", "no-requeue",
    "wrap", "parsable",
})


@dataclass(frozen=True)
class SlurmJob:
    """What one sbatch script runs.

    ``commands`` holds one argv per array index; pretraining and fine-tuning have exactly one.
    Paths are absolute: the job starts in ``workdir`` on another machine, possibly days later.
    """

    kind: str
    job_name: str
    nodes: str  # "N", or "MIN-MAX": Slurm starts (and requeues) the job on as many as it can give in the range
    gpus_per_node: int
    time: str
    workdir: str
    run_dir: str
    commands: tuple[tuple[str, ...], ...]
    signal_seconds: int = 300
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    array: str | None = None  # eval only; default: every index of ``commands``
    mem: str | None = None  # per node, sbatch's form: 64G, 500000M, 0 (all of it)
    setup: tuple[str, ...] = ()  # shell lines run before srun (module load, venv activation)
    sbatch_args: tuple[str, ...] = ()  # further #SBATCH options, e.g. --qos=high, --constraint=a100

    @property
    def script_path(self) -> str:
        return f"{self.run_dir}/submit/{self.kind}.sbatch"

    @property
    def log_pattern(self) -> str:
        return f"{self.run_dir}/submit/slurm-" + ("%A_%a.out" if self.kind == "eval" else "%j.out")


def time_limit_seconds(value: str) -> int:
    """``[D-]HH:MM:SS`` -> seconds (the forms of ``sbatch --time`` we accept)."""
    match = _TIME.match(value)
    if not match:
        raise ConfigError(f"--time: expected HH:MM:SS or D-HH:MM:SS, got {value!r}")
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def node_range(value: str | int) -> tuple[int, int]:
    """``--nodes``: ``N`` or ``MIN-MAX`` (sbatch's forms) -> (min, max)."""
    match = _NODES.match(str(value).strip())
    if not match:
        raise ConfigError(f"--nodes: expected a count like 4 or a range like 2-8, got {value!r}")
    low, high = int(match[1]), int(match[2] or match[1])
    if low < 1 or high < low:
        raise ConfigError(f"--nodes: expected 1 <= MIN <= MAX, got {value!r}")
    return low, high


def default_signal_seconds(time: str) -> int:
    """300 s of warning before the limit, or a tenth of a short limit."""
    return max(1, min(300, time_limit_seconds(time) // 10))


def array_indices(spec: str) -> list[int]:
    """Indices named by an ``--array`` spec: ``0-3``, ``0,2,5``, ``0-10:2``, each with optional ``%K``."""
    body, _, throttle = spec.partition("%")
    if throttle and not throttle.isdigit():
        raise ConfigError(f"--array: throttle after '%' must be a number, got {spec!r}")
    indices: list[int] = []
    for item in body.split(","):
        match = _ARRAY_ITEM.match(item)
        if not match:
            raise ConfigError(f"--array: expected items like 3, 0-3 or 0-9:2 separated by ',', got {spec!r}")
        first, last, step = int(match[1]), int(match[2] or match[1]), int(match[3] or 1)
        if last < first or step < 1:
            raise ConfigError(f"--array: empty range {item!r} in {spec!r}")
        indices.extend(range(first, last + 1, step))
    return indices


def check_sbatch_value(value: str, option: str) -> str:
    """``#SBATCH`` lines are read by sbatch, not bash: allow only characters with no meaning there."""
    if not _SAFE_SBATCH_VALUE.match(value):
        raise ConfigError(
            f"{option}: {value!r} cannot go into an #SBATCH line; "
            "use only letters, digits and _ . , : / + @ = -"
        )
    return value


def check_sbatch_arg(arg: str) -> str:
    """A pass-through ``--name[=value]`` option for an ``#SBATCH`` line (not one the script sets itself)."""
    match = _SBATCH_ARG.match(arg)
    if not match:
        raise ConfigError(f"--sbatch-arg: expected --name or --name=value (e.g. --qos=high), got {arg!r}")
    if match[1] in _OWN_OPTIONS:
        raise ConfigError(
            f"--sbatch-arg {arg}: --{match[1]} is set by mplug submit; use its own option "
            "(--nodes, --gpus-per-node, --cpus-per-task, --mem, --time, --partition, --account, --array, "
            "--job-name, --signal-seconds)"
        )
    return check_sbatch_value(arg, "--sbatch-arg")


def validate(job: SlurmJob) -> None:
    if job.kind not in KINDS:
        raise ConfigError(f"kind: expected one of {', '.join(KINDS)}, got {job.kind!r}")
    node_range(job.nodes)
    if job.gpus_per_node < 0:
        raise ConfigError(
            f"--gpus-per-node: expected >= 0 (0 = one CPU process per node), got {job.gpus_per_node}"
        )
    if job.cpus_per_task is not None and job.cpus_per_task < 1:
        raise ConfigError(f"--cpus-per-task: expected >= 1, got {job.cpus_per_task}")
    limit = time_limit_seconds(job.time)
    if not 1 <= job.signal_seconds <= min(limit - 1, MAX_SIGNAL_SECONDS):
        raise ConfigError(
            f"--signal-seconds: expected between 1 and {min(limit - 1, MAX_SIGNAL_SECONDS)} "
            f"(below --time {job.time}), got {job.signal_seconds}"
        )
    if not job.commands or any(not argv for argv in job.commands):
        raise ConfigError("commands: nothing to run")
    if job.kind != "eval" and len(job.commands) != 1:
        raise ConfigError(f"{job.kind}: expected one command, got {len(job.commands)}")
    if job.kind != "eval" and job.array is not None:
        raise ConfigError(f"--array: only for eval (one array task per checkpoint and task), not {job.kind}")
    if job.array is not None:
        outside = sorted(i for i in array_indices(job.array) if i >= len(job.commands))
        if outside:
            raise ConfigError(
                f"--array: indices {outside} are beyond the {len(job.commands)} evaluations "
                f"(0-{len(job.commands) - 1})"
            )
    if job.mem is not None and not _MEM.match(job.mem):
        raise ConfigError(f"--mem: expected a size per node like 64G, 512000M or 0 (all), got {job.mem!r}")
    for arg in job.sbatch_args:
        check_sbatch_arg(arg)
    for line in job.setup:
        if "\n" in line or "\r" in line:
            raise ConfigError(f"--setup: one line per --setup, got {line!r}")
    check_sbatch_value(job.job_name, "--job-name")
    for option, value in (("--partition", job.partition), ("--account", job.account)):
        if value is not None:
            check_sbatch_value(value, option)
    for option, path in (("workdir", job.workdir), ("run folder", job.run_dir)):
        if not path.startswith("/"):
            raise ConfigError(f"{option}: expected an absolute path, got {path!r}")
        check_sbatch_value(path, option)


def _sbatch_lines(job: SlurmJob) -> list[str]:
    tasks_per_node = max(job.gpus_per_node, 1)
    options = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", f"--ntasks-per-node={tasks_per_node}"]
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task:
        options.append(f"--cpus-per-task={job.cpus_per_task}")
    if job.mem:
        options.append(f"--mem={job.mem}")
    options.append(f"--time={job.time}")
    if job.partition:
        options.append(f"--partition={job.partition}")
    if job.account:
        options.append(f"--account={job.account}")
    if job.kind == "eval":
        options.append(f"--array={job.array or f'0-{len(job.commands) - 1}'}")
    options += [
        f"--chdir={job.workdir}",
        f"--output={job.log_pattern}",
        "--open-mode=append",  # a requeued run appends to the same log
        f"--signal=B:USR1@{job.signal_seconds}",
        "--requeue",
        *job.sbatch_args,
    ]
    return [f"#SBATCH {option}" for option in options]


def _command_lines(job: SlurmJob) -> list[str]:
    def words(argv: tuple[str, ...]) -> str:
        return " ".join(shlex.quote(word) for word in argv)

    if job.kind != "eval":
        return [f"CMD=({words(job.commands[0])})"]
    lines = ['case "$SLURM_ARRAY_TASK_ID" in']
    lines += [f"  {index}) CMD=({words(argv)}) ;;" for index, argv in enumerate(job.commands)]
    lines += ['  *) echo "[job] no evaluation for array index $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac"]
    return lines


# Per kind: what the header says about preemption, what runs before the step, when to requeue.
_TRAINING = {
    "preemption": f"they checkpoint, write $RUN_DIR/{PREEMPTED_MARKER} and exit 0;\n"
    "# the job requeues itself and resumes from the latest checkpoint (--resume auto).",
    "prepare": f'rm -f "$RUN_DIR/{PREEMPTED_MARKER}"  # a stale marker must not requeue this run',
    "on_usr1": "",
    "requeue_if": f'[[ -e "$RUN_DIR/{PREEMPTED_MARKER}" ]]',
    "requeue_note": "checkpoint saved after a stop signal",
    "requeue_cleanup": f'\n  rm -f "$RUN_DIR/{PREEMPTED_MARKER}"',
}
_EVALUATION = {
    "preemption": "the array task is requeued and evaluates again.",
    "prepare": 'mkdir -p "$RUN_DIR/eval"  # metrics files go here\nsignalled=0',
    "on_usr1": "signalled=1; ",
    "requeue_if": "((signalled && rc != 0))",
    "requeue_note": "stopped by a signal before finishing",
    "requeue_cleanup": "",
}

_TEMPLATE = """\
#!/bin/bash
# Written by `mplug submit {kind}`; submit it again with: sbatch {script}
{sbatch}
#
# {layout}
# USR1 ({signal_seconds} s before the time limit, or `scancel --batch --signal=USR1 JOBID`) is
# forwarded to every task; {preemption}
set -euo pipefail

RUN_DIR={run_dir}
{setup}{commands}

# first node; sed reads every line (head -n1 may exit early and fail the pipe under pipefail)
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))  # jobs sharing a host must not share a port
# this shell runs on the first node: if another program listens on the derived port there, take a free one
if (exec 3<>"/dev/tcp/127.0.0.1/$MASTER_PORT") 2>/dev/null; then
  MASTER_PORT=$("${{CMD[0]}}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
fi
export MASTER_ADDR MASTER_PORT PYTHONUNBUFFERED=1
# each task reads its rank from SLURM_PROCID: a torchrun-style RANK / WORLD_SIZE inherited from the submitting
# shell (sbatch exports it) would make every task a rank 0 of its own one-rank world
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK ROLE_RANK TORCHELASTIC_RUN_ID
# the task count of this start: a requeued job keeps the task count of its first start in SLURM_NTASKS, but with
# --nodes MIN-MAX it may come back on another node count
TASKS=$((SLURM_JOB_NUM_NODES * {tasks_per_node}))
{cpus_export}echo "[job] $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST," \\
  "$TASKS tasks, rendezvous $MASTER_ADDR:$MASTER_PORT"
{prepare}

srun --kill-on-bad-exit=1 --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$TASKS" --ntasks-per-node={tasks_per_node} \\
  "${{CMD[@]}}" &
step=$!
trap '{on_usr1}echo "[job] USR1: forwarding to the tasks"; kill -USR1 "$step" 2>/dev/null || true' USR1
# `wait` returns early each time the trap runs: wait again until the step has really ended
while :; do
  rc=0
  wait "$step" || rc=$?
  kill -0 "$step" 2>/dev/null || break
done
if {requeue_if}; then
  echo "[job] {requeue_note}: requeueing $SLURM_JOB_ID"{requeue_cleanup}
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$rc"
"""


def render_script(job: SlurmJob) -> str:
    """The sbatch script for ``job`` (validated first; raises ConfigError naming the option)."""
    validate(job)
    tasks = "one task per GPU" if job.gpus_per_node else "one CPU task per node"
    low, high = node_range(job.nodes)
    nodes = f"{low}" if low == high else (
        f"{low}-{high} (as many as Slurm gives; a requeue may get another count and the run resumes on it)")
    layout = (
        f"{nodes} node(s) x {max(job.gpus_per_node, 1)} task(s) ({tasks}); ranks from "
        "SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID."
    )
    if job.kind == "eval":
        layout = "Array: one evaluation per SLURM_ARRAY_TASK_ID, each on\n# " + layout
    cpus_export = (
        f"export SRUN_CPUS_PER_TASK={job.cpus_per_task}  # srun >= 22.05 does not inherit it\n"
        if job.cpus_per_task
        else ""
    )
    setup = ""
    if job.setup:
        setup = ("# environment (--setup), before srun so that every task inherits it\nset +u\n"
                 + "\n".join(job.setup) + "\nset -u\n")
    return _TEMPLATE.format(
        setup=setup,
        kind=job.kind,
        script=shlex.quote(job.script_path),
        sbatch="\n".join(_sbatch_lines(job)),
        layout=layout,
        signal_seconds=job.signal_seconds,
        run_dir=shlex.quote(job.run_dir),
        commands="\n".join(_command_lines(job)),
        cpus_export=cpus_export,
        tasks_per_node=max(job.gpus_per_node, 1),
        **(_EVALUATION if job.kind == "eval" else _TRAINING),
    )
