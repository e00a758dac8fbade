"""bf16 against fp32 on the same run: two `mplug pretrain` runs of the tiny preset on the embedded demo shards,
same seed and data order, one with ``distributed.precision=fp32`` and one with ``bf16`` (DeepSpeed's
torch_autocast mode: docs/precision.md), on this machine (CPU); their per-step total losses compared
over the last ``window`` steps. Not timed.

    python -m mplug_pretrain.bench.bf16_vs_fp32 --steps 100 --out bench/results/bf16_vs_fp32.json
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def run_pair(steps: int = 100, window: int = 20, batch_size: int = 4, workdir: str | None = None) -> dict:
    from mplug_pretrain.config import REPO_ROOT
    from mplug_pretrain.train.run_log import read_log
    workdir = workdir or tempfile.mkdtemp(prefix="bf16_vs_fp32_")
    curves = {}
    for precision in ("fp32", "bf16"):
        cmd = [sys.executable, "-m", "mplug_pretrain", "pretrain", "--config",
               os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml"), f"data.batch_size={batch_size}",
               f"optim.max_steps={steps}", "distributed.zero_stage=0", f"distributed.precision={precision}",
               f"run.output_dir={workdir}", f"run.name={precision}", "run.tensorboard=false",
               "run.checkpoint_every_steps=100000"]
        env = dict(os.environ, OMP_NUM_THREADS="1")  # one thread: on a shared CPU far faster than two (bench/NOTES.md)
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{precision} run failed:\n{proc.stderr[-3000:]}")
        curves[precision] = [r["loss"] for r in read_log(os.path.join(workdir, precision))]
    last = [abs(a - b) for a, b in zip(curves["fp32"][-window:], curves["bf16"][-window:])]
    mean_fp32 = sum(curves["fp32"][-window:]) / window
    return {"steps": steps, "window": window, "batch_size": batch_size,
            "mean_abs_loss_diff_last_window": sum(last) / len(last),
            "max_abs_loss_diff_last_window": max(last),
            "mean_fp32_loss_last_window": mean_fp32,
            "mean_bf16_loss_last_window": sum(curves["bf16"][-window:]) / window,
            "loss_fp32": curves["fp32"], "loss_bf16": curves["bf16"]}


def main() -> None:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run_pair(args.steps, args.window, args.batch_size)
    summary = {k: v for k, v in result.items() if not k.startswith("loss_")}
    print(json.dumps(summary, indent=1))
    if args.out:
        from mplug_pretrain.utils.atomic_files import write_json_atomic
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
