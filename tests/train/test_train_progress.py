"""What a user sees during training: a live bar (loss, samples/s, MFU, ETA) on a real terminal (a
pseudo-tty), plain [train] lines without one; MFU in log.jsonl against an independent FLOP count."""
import os
import pty
import re
import select
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, read_log, run_mplug, tiny_pretrain_args

pytestmark = pytest.mark.slow  # two tiny DeepSpeed pretrainings (~30 s each on 2 shared cores)

STEPS = 4
CPU_PEAK = 1e11


def _run_on_pty(args, timeout=600):
    """Run the CLI with stdout and stderr on a pseudo-terminal; -> (exit code, everything it wrote)."""
    parent, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "mplug_pretrain", *args], cwd=REPO_ROOT,
                            stdin=subprocess.DEVNULL, stdout=child, stderr=child, close_fds=True)
    os.close(child)
    chunks = []
    while True:
        ready, _, _ = select.select([parent], [], [], timeout)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(parent, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(parent)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def test_terminal_shows_live_bar_with_loss_mfu_and_eta(tmp_path, demo_shards):
    args = tiny_pretrain_args(tmp_path, demo_shards, "tty", steps=STEPS,
                              extra=["distributed.zero_stage=0", f"run.cpu_peak_flops={CPU_PEAK}"])
    code, out = _run_on_pty(["pretrain", *args])
    assert code == 0, out[-3000:]
    assert re.search(r"train: +\d+%\|", out), out[-2000:]  # tqdm's bar
    assert re.search(rf"{STEPS}/{STEPS} \[\d\d:\d\d<\d\d:\d\d, +[\d.]+ *(s/step|step/s)", out), out[-2000:]  # ETA, rate
    assert re.search(r"loss=\d+\.\d{3}", out) and re.search(r"mfu=\d+\.\d%", out), out[-2000:]
    assert "checkpoint" in out


def test_without_terminal_plain_lines_for_first_and_last_step_and_mfu_logged(tmp_path, demo_shards):
    from mplug_pretrain.config import load_config
    from mplug_pretrain.tasks.pretrain.train import flops_per_sample
    args = tiny_pretrain_args(tmp_path, demo_shards, "plain", steps=STEPS,
                              extra=["distributed.zero_stage=0", f"run.cpu_peak_flops={CPU_PEAK}"])
    proc = run_mplug(["pretrain", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[train] step")]
    assert [line.split()[2] for line in lines] == ["1/4", f"{STEPS}/{STEPS}"], proc.stdout  # log_every is 10
    assert all(re.search(r"loss=\d+\.\d{4} .*sps=[\d.]+ mfu=\d+\.\d%", line) for line in lines), lines
    assert "\r" not in proc.stdout + proc.stderr  # no bar
    log = read_log(tmp_path / "plain")
    cfg = load_config(os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml"), args[2:], check_paths=False)
    for record in log:
        assert record["mfu"] == pytest.approx(record["flops_per_sample"] * record["samples_per_s"] / CPU_PEAK)
        assert record["flops_per_sample"] > 0
    # the logged count is train/flops.py's for one of the possible padded text lengths of a batch
    import torch
    possible = {flops_per_sample(cfg, {"input_ids": torch.zeros(4, t, dtype=torch.long)})
                for t in range(3, cfg.data.max_text_len + 1)}
    assert {r["flops_per_sample"] for r in log} <= possible
