"""The shared training loop driven through real `mplug pretrain` processes (DeepSpeed on CPU, the demo shards):
SIGTERM saves a checkpoint and exits cleanly, ``run.keep_last`` prunes older tags, ``--resume latest`` goes on
from the saved step; gradient accumulation with one non-finite micro-batch skips exactly that micro-batch.
The LR in the log follows the warm-up + cosine formula written out in tests/train/test_train_schedule.py."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import REPO_ROOT, read_log, run_mplug, tiny_pretrain_args
from tests.train.test_train_schedule import reference_lr

PEAK, MIN_LR = 3e-4, 1e-5  # configs/pretrain_tiny.yaml: lr_vision = lr_rest = 3e-4, min_lr = 1e-5


def _tags(run_dir) -> list[str]:
    return sorted(name for name in os.listdir(run_dir / "checkpoints") if name.startswith("step"))


def _trainer_state(run_dir, tag: str) -> dict:
    payload = torch.load(run_dir / "checkpoints" / tag / "trainer_state_rank0.pt", weights_only=True)
    return payload["trainer"]


def _wait_for_step(run_dir, step: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before step {step}: "
                                 f"{proc.stderr.read()[-3000:]}")
        if (run_dir / "log.jsonl").exists() and any(r["step"] >= step for r in read_log(run_dir)):
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout} s")


@pytest.mark.slow  # two DeepSpeed processes and a checkpoint per step: 150 s on the shared 2-core machine
def test_sigterm_saves_and_exits_cleanly_then_resume_continues(tmp_path, demo_shards):
    run_dir = tmp_path / "term"
    args = tiny_pretrain_args(tmp_path, demo_shards, "term", steps=200, extra=[
        "run.checkpoint_every_steps=1", "run.keep_last=2", "run.log_every=1", "distributed.zero_stage=2"])
    proc = subprocess.Popen([sys.executable, "-m", "mplug_pretrain", "pretrain", *args], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run_dir, 3, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    stopped = read_log(run_dir)[-1]["step"]
    assert 3 <= stopped < 200
    assert (run_dir / "preempted").read_text() == "SIGTERM"
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step{stopped:08d}"
    assert _tags(run_dir) == [f"step{stopped - 1:08d}", f"step{stopped:08d}"]  # keep_last=2 pruned the rest
    assert _trainer_state(run_dir, latest)["global_step"] == stopped
    assert not (run_dir / "model").exists()  # a preempted run leaves the final model for the finished run

    resumed = run_mplug(["pretrain", *args[:-4], "run.checkpoint_every_steps=1", "run.keep_last=2",
                         "run.log_every=1", "distributed.zero_stage=2", f"optim.max_steps={stopped + 2}",
                         "run.allow_config_change=[optim.max_steps]",
                         "--resume", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {latest}" in resumed.stdout + resumed.stderr
    assert [r["step"] for r in read_log(run_dir)] == list(range(1, stopped + 3))
    assert not (run_dir / "preempted").exists()
    assert _tags(run_dir) == [f"step{stopped + 1:08d}", f"step{stopped + 2:08d}"]
    assert (run_dir / "model" / "model.safetensors").is_file()


@pytest.mark.slow  # one DeepSpeed process of 7 micro-batches: ~45 s on the shared 2-core machine
def test_grad_accumulation_skips_only_the_nonfinite_micro_batch(tmp_path, demo_shards):
    steps, accum = 3, 2
    args = tiny_pretrain_args(tmp_path, demo_shards, "accum", steps=steps, extra=[
        f"optim.grad_accum_steps={accum}", "run.inject_nonfinite_at_steps=[1]", "run.log_every=1",
        "distributed.zero_stage=0"])
    proc = run_mplug(["pretrain", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "accum"
    log = read_log(run_dir)
    assert [r["step"] for r in log] == [1, 2, 3]
    assert [r["nonfinite_skipped"] for r in log] == [0, 1, 1]  # the first micro-batch of step 2
    for record in log:
        assert record["data_wait_share"] == pytest.approx(record["data_time"] / record["step_time"], rel=1e-9)
        for key in ("loss", "loss_itc", "loss_itm", "loss_mlm", "loss_prefixlm"):
            assert torch.isfinite(torch.tensor(record[key])), (key, record)  # the NaN never reached the sums
        lrs = {k: v for k, v in record.items() if k.startswith("lr_")}
        assert lrs and all(v == pytest.approx(reference_lr(record["step"], PEAK, 1, steps, MIN_LR), rel=1e-9)
                           for v in lrs.values()), record
    # every optimizer step took `accum` finite micro-batches, plus the one skipped: 2 + 3 + 2 batches read
    state = _trainer_state(run_dir, (run_dir / "checkpoints" / "latest").read_text().strip())
    assert (state["epoch"], state["batch_in_epoch"]) == (0, steps * accum + 1)
    assert state["nonfinite_skipped"] == 1


SLOW_LOADER_RUN = """
import json, sys, time
from mplug_pretrain.config import load_config
from mplug_pretrain.tasks.pretrain.train import build_model, build_train_loader
from mplug_pretrain.train.loop import TrainTask, run_training

class SlowStorage:  # the real pretraining loader, slower than the model whatever the machine's load: each batch
    # arrives DELAY s late, and from the second on 6x the time the loop took with the previous one
    def __init__(self, loader):
        self.loader, self.image_normalize, self.stats = loader, loader.image_normalize, loader.stats
    def __iter__(self):
        handed = None
        for batch in self.loader:
            compute = time.perf_counter() - handed if handed is not None else 0.0
            time.sleep(max(DELAY, 6 * compute))
            handed = time.perf_counter()
            yield batch

cfg = load_config(sys.argv[1], sys.argv[2:])
task = TrainTask("pretrain", build_model, lambda cfg, spec: SlowStorage(build_train_loader(cfg, spec)),
                 lambda engine, batch, state: engine(batch, alpha=0.4))
print(json.dumps(run_training(cfg, task)["summary"]))
"""


def test_log_shows_the_data_wait_share_when_the_loader_is_the_limit(tmp_path, demo_shards):
    """A real tiny pretraining run (DeepSpeed on CPU) whose loader delivers each batch at least 1 s late and 6x the
    loop's time with the previous batch: every step's log record says so (data_wait_share = data_time / step_time,
    at least delay / step_time; above 0.6 from step 2, ~0.86 when the step takes as long each time), and the
    printed line too."""
    delay, steps = 1.0, 3
    args = tiny_pretrain_args(tmp_path, demo_shards, "slow", steps=steps, extra=[
        "run.log_every=1", "distributed.zero_stage=0", "data.num_workers=0"])
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29677"}
    script = SLOW_LOADER_RUN.replace("DELAY", repr(delay))
    proc = subprocess.run([sys.executable, "-c", script, *args[1:]], check=False, cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(tmp_path / "slow")
    assert [r["step"] for r in log] == list(range(1, steps + 1))
    for record in log:
        assert record["data_time"] >= delay  # the loop measured the wait
        assert record["data_wait_share"] == pytest.approx(record["data_time"] / record["step_time"], rel=1e-9)
        assert 0 < record["step_time"] - record["data_time"]  # the model's own time is the rest
        assert delay / record["step_time"] <= record["data_wait_share"] <= 1
    assert all(r["data_wait_share"] > 0.6 for r in log[1:]), [(r["data_time"], r["step_time"]) for r in log]
    assert "of the step)" in proc.stdout


def test_to_device_normalises_uint8_images_once_and_leaves_the_rest():
    from mplug_pretrain.data.device_normalize import DeviceNormalize
    from mplug_pretrain.data.transforms import CLIP_MEAN, CLIP_STD
    from mplug_pretrain.train.loop import _to_device
    normalize = DeviceNormalize(CLIP_MEAN, CLIP_STD)
    image = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    float_image = torch.rand(2, 3, 8, 8)
    batch = {"image": image, "input_ids": torch.ones(2, 5, dtype=torch.long), "is_pad": torch.tensor([False, True]),
             "text": ["a", "b"]}
    out = _to_device(batch, torch.device("cpu"), None, normalize)
    expected = (image.double() / 255 - torch.tensor(CLIP_MEAN, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(
        CLIP_STD, dtype=torch.float64).view(1, 3, 1, 1)
    assert out["image"].dtype == torch.float32 and torch.allclose(out["image"].double(), expected, atol=1e-6)
    assert out["input_ids"].dtype == torch.long and out["is_pad"] is batch["is_pad"] and out["text"] == ["a", "b"]
    # a float image (the float path, or a test's injected NaN) passes as it is: normalised once only
    assert torch.equal(_to_device({"image": float_image}, torch.device("cpu"), None, normalize)["image"], float_image)
    with pytest.raises(ValueError, match="image_normalize"):
        _to_device({"image": image}, torch.device("cpu"))
