"""A/B step time of two checkouts of this repository, side by side in one run (issue 18, item 7).

    git worktree add /tmp/d18base <base commit>
    python bench/ab_step_loop.py --a /tmp/d18base --b . --rounds 3 --out bench/results/ab_step_loop.json

Per round, alternately for A and B (each a fresh process with that checkout first on PYTHONPATH):
  loop: `mplug pretrain` on the tiny preset, 1 rank, ZeRO 2, fp32, batch 16, 14 steps (the real training loop:
        momentum update, finiteness check, logging, one checkpoint at the end); figure: median step_time of
        log.jsonl over steps 3-14;
  bench: `mplug bench train-step`'s own case runner (`_launch`) for tiny, 1 rank, ZeRO 0/2/3, checkpointing off
        (engine forward + backward + step on one fixed batch, 1 thread); figure: its step_seconds.
Ratios are B / A of the medians over rounds (below 1: B is faster).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

BENCH_SNIPPET = ("import json; from mplug_pretrain.bench.train_step import _launch; "
                 "print('ROWS' + json.dumps(_launch(1, [['tiny', s, False] for s in (0, 2, 3)], 900)))")


def _env(tree: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.abspath(tree), ".cache", "torch_extensions"))
    return env


def loop_step_time(tree: str, shards: str, tmp: str, name: str) -> float:
    args = [sys.executable, "-m", "mplug_pretrain", "pretrain", "--config",
            os.path.join(tree, "configs", "pretrain_tiny.yaml"), f"data.train_shards={shards}",
            "data.num_workers=1", "optim.max_steps=14", "optim.warmup_steps=1", "distributed.zero_stage=2",
            f"run.output_dir={tmp}", f"run.name={name}", "run.tensorboard=false", "run.checkpoint_every_steps=1000"]
    proc = subprocess.run(args, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=1200,
                          check=False)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    with open(os.path.join(tmp, name, "log.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return statistics.median(r["step_time"] for r in records if r["step"] >= 3)


def bench_step_seconds(tree: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", BENCH_SNIPPET], cwd=tree, env=_env(tree), capture_output=True,
                          text=True, timeout=1800, check=False)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    rows = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("ROWS"))[4:])
    return {f"zero{r['zero_stage']}": r["step_seconds"] for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True, help="baseline checkout")
    parser.add_argument("--b", required=True, help="changed checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    shards = os.path.abspath(os.path.join(args.b, "data_shards", "pretrain", "train-{000000..000003}.tar"))
    figures = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for side in ("a", "b") if i % 2 == 0 else ("b", "a"):  # alternate who goes first
                tree = getattr(args, side)
                entry = {"loop_step_time": loop_step_time(tree, shards, tmp, f"{side}{i}"), **bench_step_seconds(tree)}
                figures[side].append(entry)
                print(side, i, entry, flush=True)
    keys = list(figures["a"][0])
    medians = {side: {k: statistics.median(e[k] for e in figures[side]) for k in keys} for side in figures}
    result = {"a": os.path.abspath(args.a), "b": os.path.abspath(args.b), "rounds": figures, "medians": medians,
              "ratio_b_over_a": {k: medians["b"][k] / medians["a"][k] for k in keys},
              "load_average_after": os.getloadavg()}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["ratio_b_over_a"]), flush=True)


if __name__ == "__main__":
    main()
