"""A real 2-node Slurm cluster on this machine for the whole test session (slurm/local_cluster.sh).

Use the ``slurm_cluster`` fixture; it yields a :class:`LocalSlurmCluster`:

    job_id = slurm_cluster.submit(script_path)            # sbatch --parsable
    record = slurm_cluster.wait(job_id)[0]                # blocks until the job ended
    assert record["JobState"] == "COMPLETED"
    subprocess.run(["mplug", "submit", ...], env=slurm_cluster.env)   # clients find it via SLURM_CONF

Skipped (with the reason) only where it cannot run: not root, or neither Slurm nor apt-get present.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER_SCRIPT = os.path.join(REPO_ROOT, "slurm", "local_cluster.sh")
NODES = 2
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


def _ports_free(first: int, count: int) -> bool:
    for port in range(first, first + count):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _free_port_block(count: int) -> int:
    """A run of free ports outside the jobs' MASTER_PORT range (20000-39999)."""
    for _ in range(100):
        first = random.randrange(41000, 59000)
        if _ports_free(first, count):
            return first
    raise RuntimeError(f"no {count} consecutive free ports found")


@dataclass
class LocalSlurmCluster:
    """Handle on the running cluster: its directory, the client environment, submit/wait helpers."""

    directory: str
    env: dict = field(default_factory=dict)
    nodes: tuple[str, ...] = ()

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        result = subprocess.run(
            cmd, check=False, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        return result

    def submit(self, script_path: str, *sbatch_args: str) -> str:
        """``sbatch --parsable [args] script`` -> job id."""
        return self.run("sbatch", "--parsable", *sbatch_args, script_path).stdout.strip().split(";")[0]

    def records(self, job_id: str) -> list[dict[str, str]]:
        """``scontrol show job -o``: one dict per job (one per array task for an array)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def wait(self, job_id: str, timeout: float = 120) -> list[dict[str, str]]:
        """Blocks until every record of ``job_id`` has finished; returns the records."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.records(job_id)
            if records and all(r.get("JobState") in FINISHED for r in records):
                return records
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not finished after {timeout} s: {records}")
            time.sleep(0.3)

    def signal_batch(self, job_id: str, signal: str = "USR1") -> None:
        """What ``--signal=B:USR1@T`` does near the time limit, now: signal the batch shell only."""
        self.run("scancel", "--batch", f"--signal={signal}", job_id)

    def hostnames(self, nodelist: str) -> list[str]:
        return self.run("scontrol", "show", "hostnames", nodelist).stdout.split()


def _skip_reason() -> str | None:
    if not os.path.exists("/proc/self/stat"):
        return "the local Slurm cluster needs Linux"
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd starts the job processes); CI runs as root"
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return "Slurm is not installed and apt-get is unavailable to install it"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    # short path under /tmp: munge's socket path must stay under ~100 characters
    directory = tempfile.mkdtemp(prefix="mplug-slurm-test-", dir="/tmp")
    port = _free_port_block(NODES + 1)
    env = dict(
        os.environ,
        MPLUG_SLURM_DIR=directory,
        MPLUG_SLURM_NODES=str(NODES),
        MPLUG_SLURM_PORT=str(port),
        MPLUG_SLURM_NODE_PREFIX="node",
        MPLUG_SLURM_CPUS_PER_NODE="8",  # jobs ask for the loader workers + 2 CPUs per task
        # jobs derive MASTER_PORT from the job id: differ from any other cluster on this host
        MPLUG_SLURM_FIRST_JOB_ID=str(random.randrange(1, 19000)),
        SLURM_CONF=os.path.join(directory, "etc", "slurm.conf"),
    )
    for name in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        del env[name]  # a test session started inside a Slurm job must not leak that job's variables
    started = time.monotonic()
    up = subprocess.run(
        ["bash", CLUSTER_SCRIPT, "up"], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    try:
        if up.returncode != 0 or "ready" not in up.stdout:
            pytest.fail(f"local Slurm cluster did not start ({up.returncode}):\n{up.stdout}\n{up.stderr}")
        print(f"\n[slurm] local cluster up in {time.monotonic() - started:.1f} s ({directory})")
        yield LocalSlurmCluster(
            directory=directory, env=env, nodes=tuple(f"node{k}" for k in range(1, NODES + 1))
        )
    finally:
        subprocess.run(
            ["bash", CLUSTER_SCRIPT, "stop"],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        shutil.rmtree(directory, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Without a cluster: run a rendered script under real bash, with stand-ins for srun and scontrol.

FAKE_SRUN = """#!/bin/bash
# one task on this machine: record srun's own options (one line per call), drop them, run the command
options=()
while [[ ${1:-} == --* ]]; do options+=("$1"); shift; done
echo "${options[*]}" >> "$FAKE_SLURM_LOG.srun"
SLURM_PROCID=0 SLURM_LOCALID=0 SLURMD_NODENAME=node1 exec "$@"
"""

FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo node1; echo node2 ;;
  requeue*) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""

ARGV_RECORDER = """#!/bin/bash
# stands in for python: records its arguments (and where it ran) as JSON, one file per call;
# like `mplug eval`, it also writes a metrics file where `--out` points
exec {python} -c 'import json, os, sys, uuid
record = {{"argv": sys.argv[1:], "node": os.environ.get("SLURMD_NODENAME"),
          "array_task": os.environ.get("SLURM_ARRAY_TASK_ID")}}
name = "argv-" + os.environ.get("SLURM_PROCID", "x") + "-" + uuid.uuid4().hex + ".json"
json.dump(record, open(os.path.join({outdir_json}, name), "w"))
if "--out" in sys.argv:
    json.dump(record, open(sys.argv[sys.argv.index("--out") + 1], "w"))' "$@"
"""


@dataclass
class FakeSlurm:
    """Runs scripts with fake ``srun``/``scontrol`` first on PATH; records ``scontrol requeue`` calls."""

    bin_dir: str
    log: str

    def run(self, script: str, cwd: str, **env: str) -> subprocess.CompletedProcess:
        path = os.path.join(cwd, "job.sbatch")
        with open(path, "w") as f:
            f.write(script)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        full_env.update(
            PATH=f"{self.bin_dir}:{os.environ['PATH']}",
            FAKE_SLURM_LOG=self.log,
            SLURM_JOB_ID="123",
            SLURM_JOB_NODELIST="node[1-2]",
            SLURM_NTASKS="1",
            SLURM_JOB_NUM_NODES="1",
        )
        full_env.update(env)  # a test's own values win (SLURM_JOB_ID, ...)
        return subprocess.run(
            ["bash", path], check=False, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=60
        )

    def srun_options(self) -> list[str]:
        """srun's own options, one string per call."""
        with open(self.log + ".srun") as f:
            return f.read().splitlines()

    def requeues(self) -> list[str]:
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return f.read().splitlines()


@pytest.fixture
def fake_slurm(tmp_path) -> FakeSlurm:
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return FakeSlurm(bin_dir=str(bin_dir), log=str(tmp_path / "fake-slurm.log"))


@dataclass
class ArgvRecorder:
    """An executable to pass as ``--python``: each call leaves a JSON file with its argv."""

    path: str
    outdir: str

    def calls(self) -> list[dict]:
        calls = []
        for name in sorted(os.listdir(self.outdir)):
            with open(os.path.join(self.outdir, name)) as f:
                calls.append(json.load(f))
        return calls


@pytest.fixture
def argv_recorder(tmp_path) -> ArgvRecorder:
    outdir = tmp_path / "recorded-argv"
    outdir.mkdir()
    path = tmp_path / "recording-python"
    path.write_text(
        ARGV_RECORDER.format(python=shlex.quote(sys.executable), outdir_json=json.dumps(str(outdir)))
    )
    path.chmod(0o755)
    return ArgvRecorder(path=str(path), outdir=str(outdir))


@pytest.fixture
def submit_config(tmp_path) -> str:
    """A run config for `mplug submit`: run ``tiny_run`` under ``tmp_path/runs``, one (empty) shard, which also
    stands for the caption and VQA evaluation sets."""
    shard = tmp_path / "shards" / "train-000000.tar"
    shard.parent.mkdir()
    shard.touch()
    path = tmp_path / "tiny_run.yaml"
    path.write_text(
        f"model:\n  preset: tiny\n"
        f"data:\n  train_shards: {shard}\nrun:\n  name: tiny_run\n  output_dir: {tmp_path / 'runs'}\n"
        f"caption:\n  val_shards: {shard}\nvqa:\n  val_shards: {shard}\n"
    )
    return str(path)


@pytest.fixture
def make_model_folder():
    return _make_model_folder


def _make_model_folder(path, classifier_classes: int = 0) -> str:
    """What `mplug submit eval` checks of a model folder: a config.json (a default ModelConfig) and a weights
    file (empty: nothing loads it before the job runs)."""
    from dataclasses import replace

    from mplug_pretrain.models.folder.config_io import write_model_config
    from mplug_pretrain.models.model_config import ModelConfig

    os.makedirs(path, exist_ok=True)
    config = ModelConfig()
    config = replace(config, heads=replace(config.heads, classifier_classes=classifier_classes))
    write_model_config(config, os.path.join(path, "config.json"))
    open(os.path.join(path, "model.safetensors"), "wb").close()
    return str(path)
