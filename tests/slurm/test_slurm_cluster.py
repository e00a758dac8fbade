"""The sbatch template on a real 2-node Slurm cluster (one machine): rendezvous across nodes,
USR1 -> checkpoint marker -> requeue -> restart, and evaluation arrays.

The jobs run small Python programs in place of `mplug` so the template is tested on its own;
the end-to-end pretraining test (`mplug submit pretrain` on this cluster) belongs beside them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from mplug_pretrain.slurm.script import SlurmJob, render_script
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.slow

GLOO_ALL_REDUCE = """
import json, os, torch, torch.distributed as dist
rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", rank=rank, world_size=world_size)  # MASTER_ADDR/PORT from the script
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
print("RESULT " + json.dumps({"rank": dist.get_rank(), "node": os.environ["SLURMD_NODENAME"], "sum": x.item(),
      "master": [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])]}), flush=True)
dist.destroy_process_group()  # else gloo may abort at exit once the peer is gone
"""

# Stands in for the trainer's contract: on USR1 every rank stops, rank 0 writes <run_dir>/preempted,
# all exit 0. A restarted job finishes at once and records the restart count it saw.
PREEMPTIBLE_TRAINER = """
import os, signal, sys, time
run_dir, rank, restart = sys.argv[1], os.environ["SLURM_PROCID"], os.environ.get("SLURM_RESTART_COUNT", "0")
if restart != "0":
    open(os.path.join(run_dir, f"finished-{rank}"), "w").write(restart)
    sys.exit(0)
stop = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
open(os.path.join(run_dir, f"started-{rank}"), "w").close()
deadline = time.time() + 300  # generous: the test signals once every rank started, on a busy machine too
while not stop and time.time() < deadline:
    time.sleep(0.05)
if not stop:
    sys.exit(3)
open(os.path.join(run_dir, f"got-usr1-{rank}"), "w").close()
if rank == "0":
    open(os.path.join(run_dir, "preempted"), "w").write("USR1")
"""

WRITE_ARRAY_RESULT = """
import json, os, sys
record = {"array_task": int(os.environ["SLURM_ARRAY_TASK_ID"]), "argv": sys.argv[1:]}
json.dump(record, open(sys.argv[1], "w"))
"""


def _job(kind: str, run_dir: str, commands, nodes: int = 2) -> SlurmJob:
    return SlurmJob(
        kind=kind,
        job_name=f"test-{kind}",
        nodes=nodes,
        gpus_per_node=0,
        time="00:05:00",
        workdir=run_dir,
        run_dir=run_dir,
        commands=tuple(tuple(c) for c in commands),
        signal_seconds=60,
    )


def _write(job: SlurmJob) -> str:
    os.makedirs(os.path.dirname(job.script_path), exist_ok=True)
    with open(job.script_path, "w") as f:
        f.write(render_script(job))
    return job.script_path


def _log(job: SlurmJob, job_id: str) -> str:
    with open(job.log_pattern.replace("%j", job_id)) as f:
        return f.read()


def test_two_nodes_rendezvous_and_gloo_all_reduce(slurm_cluster, tmp_path):
    run_dir = str(tmp_path)
    job = _job("pretrain", run_dir, [(sys.executable, "-c", GLOO_ALL_REDUCE)])
    (tmp_path / "preempted").write_text("stale")  # left by an earlier run: must not cause a requeue
    job_id = slurm_cluster.submit(_write(job))
    record = slurm_cluster.wait(job_id)[0]
    log = _log(job, job_id)
    assert record["JobState"] == "COMPLETED", log
    results = [
        json.loads(line.split("RESULT ", 1)[1]) for line in log.splitlines() if line.startswith("RESULT ")
    ]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {r["node"] for r in results} == set(slurm_cluster.nodes)  # one rank per node
    assert all(r["sum"] == 1.0 + 2.0 for r in results)  # rank+1 summed over ranks 0 and 1
    first_node = slurm_cluster.hostnames(record["NodeList"])[0]
    assert all(r["master"] == [first_node, 20000 + int(job_id) % 20000] for r in results)
    assert record["Restarts"] == "0" and not (tmp_path / "preempted").exists()


def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    run_dir = str(tmp_path)
    job = _job("pretrain", run_dir, [(sys.executable, "-c", PREEMPTIBLE_TRAINER, run_dir)])
    job_id = slurm_cluster.submit(_write(job))
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"started-{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline, slurm_cluster.records(job_id)
        time.sleep(0.1)
    slurm_cluster.signal_batch(job_id, "USR1")  # what --signal=B:USR1@60 does 60 s before the limit
    record = slurm_cluster.wait(job_id, timeout=120)[0]
    log = _log(job, job_id)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", log
    assert record["Restarts"] == "1", log
    assert (tmp_path / "got-usr1-0").exists() and (tmp_path / "got-usr1-1").exists(), log  # forwarded to both
    assert [(tmp_path / f"finished-{rank}").read_text() for rank in (0, 1)] == ["1", "1"]
    assert "requeueing" in log and not (tmp_path / "preempted").exists()


def test_eval_array_runs_one_command_per_index(slurm_cluster, tmp_path):
    outputs = [str(tmp_path / f"metrics-{i}.json") for i in range(2)]
    job = _job(
        "eval",
        str(tmp_path),
        [(sys.executable, "-c", WRITE_ARRAY_RESULT, out, f"task {i}") for i, out in enumerate(outputs)],
        nodes=1,
    )
    job_id = slurm_cluster.submit(_write(job))
    records = slurm_cluster.wait(job_id)
    assert sorted(r["ArrayTaskId"] for r in records) == ["0", "1"]
    assert all(r["JobState"] == "COMPLETED" for r in records), records
    for index, out in enumerate(outputs):
        with open(out) as f:
            assert json.load(f) == {"array_task": index, "argv": [out, f"task {index}"]}


def _mplug_submit(slurm_cluster, cwd, *argv: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "mplug_pretrain", "submit", *argv],
        check=False,
        cwd=cwd,
        env={**slurm_cluster.env, "PYTHONPATH": REPO_ROOT},  # this checkout's package, whatever is installed
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    assert job_id.isdigit(), result.stdout
    return job_id


def test_mplug_submit_pretrain_and_eval_array(
    slurm_cluster, tmp_path, submit_config, argv_recorder, make_model_folder
):
    """`mplug submit` end to end; a recording "python" stands in for the training and evaluation. Pretraining
    takes its python from a --setup line (as `source venv/bin/activate` would), with --mem and a passed-through
    sbatch option that Slurm must accept."""
    run_dir = tmp_path / "runs" / "tiny_run"
    bin_dir = tmp_path / "venv-bin"
    bin_dir.mkdir()
    os.symlink(argv_recorder.path, bin_dir / "python")
    job_id = _mplug_submit(
        slurm_cluster,
        str(tmp_path),
        "pretrain",
        "--nodes",
        "2",
        "--time",
        "00:05:00",
        "--config",
        submit_config,
        "--setup",
        f'export PATH={bin_dir}:"$PATH"',
        "--mem",
        "100M",
        "--sbatch-arg=--comment=mplug-test",
        "optim.lr_rest=5e-5",
    )
    record = slurm_cluster.wait(job_id)[0]
    assert record["JobState"] == "COMPLETED", (run_dir / "submit" / f"slurm-{job_id}.out").read_text()
    calls = argv_recorder.calls()
    assert sorted(c["node"] for c in calls) == list(slurm_cluster.nodes)
    assert all(
        c["argv"]
        == [
            "-m",
            "mplug_pretrain",
            "pretrain",
            "--config",
            submit_config,
            "--resume",
            "auto",
            "optim.lr_rest=5e-5",
        ]
        for c in calls
    )
    assert (run_dir / "submit" / "pretrain.sbatch").is_file()
    job = slurm_cluster.run("scontrol", "show", "job", job_id).stdout
    assert "MinMemoryNode=100M" in job and "Comment=mplug-test" in job and "MinCPUsNode=4" in job, job

    checkpoints = [tmp_path / "ckpt-a", tmp_path / "ckpt-b"]
    for c in checkpoints:
        make_model_folder(c)
    array_id = _mplug_submit(
        slurm_cluster,
        str(tmp_path),
        "eval",
        "caption",
        "--time",
        "00:05:00",
        "--config",
        submit_config,
        "--python",
        argv_recorder.path,
        "--checkpoint",
        *map(str, checkpoints),
    )
    records = slurm_cluster.wait(array_id)
    assert sorted(r["JobState"] for r in records) == ["COMPLETED", "COMPLETED"], records
    for index, checkpoint in enumerate(checkpoints):
        # a folder outside a run is labelled <parent>-<folder> (array outputs never collide across runs)
        metrics = run_dir / "eval" / f"{index}-caption-{checkpoint.parent.name}-{checkpoint.name}.json"
        recorded = json.loads(metrics.read_text())
        assert recorded["array_task"] == str(index)
        assert recorded["argv"][recorded["argv"].index("--checkpoint") + 1] == str(checkpoint)


# ---- End-to-end pretraining on this cluster (to be added beside the tests above) --------------
# With the real trainer, through `_mplug_submit(slurm_cluster, ...)` and `slurm_cluster.wait(...)`:
# 2-node tiny pretraining (ranks 0 and 1 on different nodes, loss went down, checkpoint exists);
# `slurm_cluster.signal_batch(job_id)` mid-run -> checkpointed, requeued, resumed, full step count,
# no step lost beyond the last checkpoint and none repeated in log.jsonl; `mplug submit eval` with
# two checkpoints -> two metrics files under <run_dir>/eval/.
