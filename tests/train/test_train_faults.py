"""Issue 24, items 2, 3, 4 and 10 on real runs (tiny preset, CPU, real DeepSpeed over gloo, real shards):

* a shard set with bad JSON samples trains through on 2 ranks; the skipped samples are counted by kind, summed
  over both ranks, carried across the epoch boundary and a kill -9 + resume, and reported in log.jsonl and the
  final ``[data]`` line (expected counts come from the shards this test writes);
* SIGTERM to the process group of a running ``mplug pretrain`` (DataLoader workers included, as ``scancel`` and
  Slurm time limits send it) checkpoints, exits as preempted, and the run resumes to its end;
* SIGTERM or SIGKILL to the ``mplug pretrain --nproc 2`` process leaves no process of the run alive.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from mplug_pretrain.data.writers.shard_writer import ShardWriter
from tests.helpers import REPO_ROOT, read_log, run_mplug
from tests.train.test_train_corrupt_first_batch import _jpeg

pytestmark = pytest.mark.slow

GOOD, BAD = 5, {"huge_id": ({"image_id": 2**70}, "bad_image_id"), "list_json": ([1, 2], "bad_json")}
KEPT = {"image_id": "²"}  # int("²") raised before: a string id now, hashed like any other
BATCH = 4


def write_shards(folder: str, shards: int) -> str:
    """``shards`` shards of GOOD good samples, one with the KEPT json and one of each BAD sample (8 in all)."""
    for s in range(shards):
        with ShardWriter(folder, f"part{s}", kind="image-text", created_by="test") as writer:
            for i in range(GOOD):
                writer.write({"__key__": f"g{s}_{i:03d}", "jpg": _jpeg(i), "txt": f"picture {i} of part {s}",
                              "json": {"image_id": 1000 * s + i}})
            writer.write({"__key__": f"kept{s}", "jpg": _jpeg(s + 7), "txt": "a kept picture", "json": KEPT})
            for key, (meta, _) in BAD.items():
                writer.write({"__key__": f"{key}{s}", "jpg": _jpeg(s), "txt": "fine text", "json": meta})
    return os.path.join(folder, "part{0.." + str(shards - 1) + "}-000000.tar")


def train_args(tmp_path, shards: str, name: str, steps: int, extra=()) -> list[str]:
    return ["pretrain", "--config", os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml"),
            f"data.train_shards={shards}", f"data.batch_size={BATCH}", "data.num_workers=1",
            f"optim.max_steps={steps}", "optim.warmup_steps=1", f"run.output_dir={tmp_path}", f"run.name={name}",
            "run.tensorboard=false", "model.heads.queue_size=16", "distributed.zero_stage=1", *extra]


def test_bad_json_counts_over_two_ranks_epochs_and_resume(tmp_path):
    shards = write_shards(str(tmp_path / "shards"), shards=2)
    # 2 ranks x 1 worker, one shard of 8 samples each: 2 batches (steps) per epoch, 4 steps = 2 epochs
    per_epoch = {kind: 2 for _, kind in BAD.values()}  # one of each bad kind per shard, 2 shards
    args = train_args(tmp_path, shards, "counts", steps=4, extra=["run.log_every=2", "run.checkpoint_every_steps=2"])
    proc = run_mplug(["pretrain", "--nproc", "2", *args[1:]], env={"MPLUG_TEST_KILL_DURING_SAVE_AT_STEP": "4"},
                     timeout=600)
    assert proc.returncode != 0  # killed -9 while saving step 4: latest stays step 2 (end of epoch 0)
    run_dir = tmp_path / "counts"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000002"
    proc = run_mplug(["pretrain", "--nproc", "2", *args[1:], "--resume", "latest"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = {r["step"]: r for r in read_log(run_dir)}
    assert sorted(log) == [1, 2, 3, 4]
    assert log[2]["data_skipped"] == per_epoch and log[2]["corrupt_skipped"] == sum(per_epoch.values())
    two_epochs = {kind: 2 * n for kind, n in per_epoch.items()}
    assert log[4]["data_skipped"] == two_epochs and log[4]["corrupt_skipped"] == sum(two_epochs.values())
    usable = 2 * (GOOD + 1)  # per epoch, both shards
    decoded, padded = 2 * usable, 2 * (2 * 2 * BATCH - usable)  # 2 epochs; 2 ranks x 2 batches x BATCH slots
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(two_epochs.items()))
    assert (f"[data] decoded {decoded}, skipped {sum(two_epochs.values())} ({reasons}), padded {padded}"
            in proc.stdout), proc.stdout[-2000:]


def _processes_of(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (zombies have an empty one)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _wait_for_records(run_dir, victim, count: int, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and victim.poll() is None:
        if (run_dir / "log.jsonl").exists() and len(read_log(run_dir)) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"the run logged fewer than {count} steps (exit {victim.poll()})")


def test_sigterm_to_the_process_group_checkpoints_and_resumes(tmp_path):
    shards = write_shards(str(tmp_path / "shards"), shards=2)
    steps = 6  # few: on a busy 2-core machine each step and each process start takes seconds
    args = train_args(tmp_path, shards, "term", steps=steps, extra=["run.log_every=1"])
    run_dir = tmp_path / "term"
    victim = subprocess.Popen([sys.executable, "-m", "mplug_pretrain", *args], cwd=REPO_ROOT,
                              start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_records(run_dir, victim, 1)
        os.killpg(victim.pid, signal.SIGTERM)  # the main process and its DataLoader worker, as scancel does
        out, err = victim.communicate(timeout=300)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
    assert victim.returncode == 0, err[-3000:]
    assert "stop requested (SIGTERM)" in out
    assert (run_dir / "preempted").read_text().strip() == "SIGTERM"
    tag = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(tag.removeprefix("step"))
    assert 1 <= stopped_at < steps
    proc = run_mplug([*args, "--resume", "latest"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {tag}" in proc.stdout
    assert [r["step"] for r in read_log(run_dir)] == list(range(1, steps + 1))
    assert (run_dir / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("sig, rank_start", [(signal.SIGTERM, "fork"), (signal.SIGUSR1, "exec")],
                         ids=["SIGTERM-forked", "SIGUSR1-torchrun"])
def test_a_stop_signal_to_the_nproc_launcher_saves_and_exits_0_without_a_traceback(tmp_path, sig, rank_start):
    """Issue 37, item 5: torchrun once exited 1 with a SignalException traceback (SIGTERM) or died of SIGUSR1.
    Both launchers: forked ranks (utils/fork_launch.py) and torchrun's fresh interpreters (cli/torchrun_launch.py)."""
    shards = write_shards(str(tmp_path / "shards"), shards=2)
    args = train_args(tmp_path, shards, "stop", steps=400,
                      extra=["run.log_every=1", f"distributed.rank_start={rank_start}"])
    run_dir = tmp_path / "stop"
    victim = subprocess.Popen([sys.executable, "-m", "mplug_pretrain", "pretrain", "--nproc", "2", *args[1:]],
                              cwd=REPO_ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        _wait_for_records(run_dir, victim, 1)
        os.kill(victim.pid, sig)  # the `mplug` process only: Slurm's --signal=B:USR1, or `kill PID`
        out, err = victim.communicate(timeout=300)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
    assert victim.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert f"[launcher] {sig.name} passed to the 2 rank(s)" in err and f"stop requested ({sig.name})" in out
    assert (run_dir / "preempted").read_text().strip() == sig.name
    tag = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert 1 <= int(tag.removeprefix("step")) < 400
    assert not _processes_of(f"run.output_dir={tmp_path}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killing_the_nproc_parent_leaves_no_rank_alive(tmp_path, sig):
    shards = write_shards(str(tmp_path / "shards"), shards=2)
    args = train_args(tmp_path, shards, "orphans", steps=400, extra=["run.log_every=1"])
    marker = f"run.output_dir={tmp_path}"
    victim = subprocess.Popen([sys.executable, "-m", "mplug_pretrain", "pretrain", "--nproc", "2", *args[1:]],
                              cwd=REPO_ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        _wait_for_records(tmp_path / "orphans", victim, 1)
        assert len(_processes_of(marker)) >= 3  # the launcher and two ranks (and their DataLoader workers)
        start = time.time()
        os.kill(victim.pid, sig)  # the `mplug` process only, as `kill PID` or the OOM killer would
        while time.time() - start < 60 and (victim.poll() is None or _processes_of(marker)):
            time.sleep(0.1)
        left = _processes_of(marker)
        print(f"{sig.name}: every process of the run gone after {time.time() - start:.1f} s")
        assert not left, f"still alive {time.time() - start:.0f} s after {sig.name}: {left}"
    finally:
        for pid in _processes_of(marker):
            os.kill(pid, signal.SIGKILL)
        if victim.poll() is None:
            victim.kill()
        victim.wait()
