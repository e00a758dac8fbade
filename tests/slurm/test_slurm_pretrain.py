"""Real pretraining on the local Slurm cluster: 2 nodes, preemption with requeue and resume, and an
evaluation job array. Uses the project's own slurm/local_cluster.sh through the `slurm_cluster` fixture."""
import json
import os
import subprocess
import sys
import time

import pytest

from mplug_pretrain.demo.vocab import vocab_size
from tests.helpers import REPO_ROOT, read_log

pytestmark = pytest.mark.slow


def submit(slurm_cluster, *argv):
    result = subprocess.run([sys.executable, "-m", "mplug_pretrain", "submit", *argv], check=False, cwd=REPO_ROOT,
                            env=slurm_cluster.env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    assert job_id.isdigit(), result.stdout
    return job_id


def pretrain_config(tmp_path, demo_shards, name, steps, checkpoint_every):
    """The tiny preset with the demo shards' own vocabulary (268 words: BERT's 30,522 rows were half a tiny step)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
model: {{preset: tiny, heads: {{queue_size: 64}}, text: {{vocab_size: {vocab_size(demo_shards['tokenizer'])}}}}}
data: {{train_shards: "{demo_shards['pretrain_train']}", batch_size: 4, num_workers: 1,
        tokenizer: "{demo_shards['tokenizer']}"}}
optim: {{lr_vision: 1.0e-3, lr_rest: 1.0e-3, min_lr: 1.0e-5, warmup_steps: 1, max_steps: {steps}}}
distributed: {{zero_stage: 2, precision: fp32}}
run: {{name: {name}, output_dir: "{tmp_path}", checkpoint_every_steps: {checkpoint_every}, tensorboard: false}}
""")
    return str(path)


def job_output(run_dir, job_id):
    path = os.path.join(run_dir, "submit", f"slurm-{job_id}.out")
    return open(path).read() if os.path.exists(path) else ""


@pytest.fixture(scope="module")
def two_node_run(slurm_cluster, module_mktemp, demo_shards):
    tmp_path = module_mktemp("slurm_pretrain")
    cfg = pretrain_config(tmp_path, demo_shards, "twonode", steps=12, checkpoint_every=6)
    job_id = submit(slurm_cluster, "pretrain", "--nodes", "2", "--gpus-per-node", "0", "--time", "00:20:00",
                    "--config", cfg)
    record = slurm_cluster.wait(job_id, timeout=900)[0]
    return tmp_path / "twonode", job_id, record


def test_two_node_pretraining(two_node_run):
    run_dir, job_id, record = two_node_run
    assert record["JobState"] == "COMPLETED", job_output(run_dir, job_id)[-3000:]
    world = [json.loads(line) for line in (run_dir / "world.json").read_text().splitlines()]
    assert world[0]["world_size"] == 2 and world[0]["launcher"] == "srun"
    assert world[0]["hosts"][0] != world[0]["hosts"][1], world
    log = read_log(run_dir)
    assert [r["step"] for r in log] == list(range(1, 13))
    first, last = sum(r["loss"] for r in log[:3]) / 3, sum(r["loss"] for r in log[-3:]) / 3
    assert last < first, (first, last)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000012"
    assert (run_dir / "model" / "model.safetensors").is_file()


def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path, demo_shards):
    steps = 40
    cfg = pretrain_config(tmp_path, demo_shards, "preempt", steps=steps, checkpoint_every=1000)
    run_dir = tmp_path / "preempt"
    job_id = submit(slurm_cluster, "pretrain", "--nodes", "2", "--gpus-per-node", "0", "--time", "00:20:00",
                    "--config", cfg)
    log_path = run_dir / "log.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:
        if log_path.exists() and len(log_path.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    slurm_cluster.signal_batch(job_id)  # what --signal=B:USR1@T does before the time limit
    record = slurm_cluster.wait(job_id, timeout=900)[0]
    out = job_output(run_dir, job_id)
    assert record["JobState"] == "COMPLETED", out[-3000:]
    assert int(record.get("Restarts", "0")) == 1, record
    saved = [line for line in out.splitlines() if "stop requested" in line]
    assert saved, out[-3000:]
    saved_step = int(saved[0].split("saved at step ")[1].split(",")[0])
    assert 3 <= saved_step < steps
    assert f"resumed from step{saved_step:08d}" in out
    assert [r["step"] for r in read_log(run_dir)] == list(range(1, steps + 1)), "a step lost or repeated"
    world = [json.loads(line) for line in (run_dir / "world.json").read_text().splitlines()]
    assert [w["slurm_restart_count"] in (None, "0") for w in world] == [True, False]
    assert not (run_dir / "preempted").exists()


def test_evaluation_job_array_writes_one_metrics_file_per_task(slurm_cluster, two_node_run, tmp_path,
                                                               demo_shards):
    run_dir, _, _ = two_node_run
    model = run_dir / "model"
    checkpoints = [tmp_path / "ckpt-a", tmp_path / "ckpt-b"]
    for c in checkpoints:
        os.symlink(model, c)
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(f"""
eval: {{shards: "{demo_shards['pretrain_val']}", k_test: 4, batch_size: 32}}
run: {{name: evalarray, output_dir: "{tmp_path}"}}
""")
    job_id = submit(slurm_cluster, "eval", "retrieval", "--time", "00:10:00", "--config", str(cfg),
                    "--checkpoint", *map(str, checkpoints))
    records = slurm_cluster.wait(job_id, timeout=900)
    assert sorted(r["JobState"] for r in records) == ["COMPLETED", "COMPLETED"], records
    files = sorted((tmp_path / "evalarray" / "eval").glob("*.json"))
    assert len(files) == 2, files
    metrics = [json.loads(f.read_text()) for f in files]
    assert [m["checkpoint"] for m in metrics] == [str(c) for c in checkpoints]
    for m in metrics:
        m.pop("checkpoint")
    assert metrics[0] == metrics[1]  # the same model twice, evaluated by two array tasks
    assert "txt_r1" in json.dumps(metrics[0])
