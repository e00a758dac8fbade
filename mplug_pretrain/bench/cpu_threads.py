"""`mplug bench cpu-threads`: torch's CPU threads on a machine that is doing something else too.

Runs the same work in fresh processes (the OpenMP settings are read once, when torch loads) under each
(wait policy, threads) setting: libgomp's default (spin ~300k turns, then sleep), ``PASSIVE`` (sleep at
once), ``PASSIVE+spin10k`` (OMP_WAIT_POLICY=PASSIVE with GOMP_SPINCOUNT=10000: spin 10k turns, then sleep;
what ``import mplug_pretrain`` sets), and 1 or all cores' threads; each with no competition and beside busy
loops (one per core, the "CPU hog" of issue 28), in interleaved rounds. Two kinds of work:

    step    forward + backward of the tiny preset's pretraining loss (batch 24, 64 px, the demo's 268-word
            vocabulary), ``STEPS`` times: the demo's many small operations
    matmul  ``MATMULS`` products of two 256 x 256 fp32 matrices: one large operation at a time

Rows: work, policy (a ``POLICIES`` name), threads, hog (busy loops beside it), seconds (one round), round.
``mplug_pretrain/__init__.py`` sets PASSIVE+spin10k unless the user chose a policy, because of what this
measures; the load average before and after is recorded with the rows.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from mplug_pretrain.bench.common import write_bench

STEPS, MATMULS = 4, 2000
POLICIES = {"default": {}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
            "PASSIVE+spin10k": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}}
_WORK = r"""
import sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
if sys.argv[1] == "matmul":
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range({matmuls}):
        a @ a
else:
    from mplug_pretrain.models.presets import build_model
    torch.manual_seed(0)
    model = build_model("tiny", **{{"text.vocab_size": 268}})
    ids = torch.randint(104, 268, (24, 20))
    ids[:, 0], ids[:, -1] = 101, 102
    batch = {{"image": torch.randn(24, 3, 64, 64), "input_ids": ids, "attention_mask": torch.ones_like(ids),
             "image_id": torch.arange(24), "is_pad": torch.zeros(24, dtype=torch.bool)}}
    model(batch)["loss"].backward()  # warm-up
    start = time.perf_counter()
    for _ in range({steps}):
        model(batch)["loss"].backward()
print(time.perf_counter() - start)
"""


def _timed(work: str, policy: str, threads: int, steps: int, matmuls: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(POLICIES[policy])
    code = _WORK.format(steps=steps, matmuls=matmuls)
    out = subprocess.run([sys.executable, "-c", code, work, str(threads)], env=env, capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def run(out: str, quick: bool = False) -> dict:
    cores = os.cpu_count() or 1
    steps, matmuls, rounds = (1, 200, 1) if quick else (STEPS, MATMULS, 2)
    settings = [(policy, threads) for policy in POLICIES for threads in sorted({1, cores})]
    load_before = os.getloadavg()
    rows = []
    for round_index in range(rounds):
        for hog in (False, True):
            loops = _busy_loops(cores) if hog else []
            try:
                time.sleep(1.0 if hog else 0.0)
                for work in ("step", "matmul"):
                    for policy, threads in settings:
                        seconds = _timed(work, policy, threads, steps, matmuls)
                        rows.append({"work": work, "policy": policy, "threads": threads, "hog": hog,
                                     "seconds": seconds, "round": round_index})
                        print(f"[cpu-threads] {rows[-1]}", flush=True)
            finally:
                for loop in loops:
                    loop.kill()
                    loop.wait()
    return write_bench("cpu-threads", rows, out, steps=steps, matmuls=matmuls, cores=cores,
                       load_average_before=load_before, load_average_after=os.getloadavg())
