"""`mplug bench train-step`: one pretraining step (all four losses, forward + backward + AdamW step) through
the real DeepSpeed engine (train/engine.py, the shipped deepspeed_configs/zero{0,1,2,3}.json), fp32 on CPU with
gloo, for 1 and 2 ranks (one subprocess that forks its ranks as ``mplug pretrain --nproc N`` does, or
torchrun's where they cannot be forked: utils/fork_launch.py), ZeRO 0/1/2/3, gradient checkpointing off and on. Every row runs
its stage as written, on one rank too (distributed.single_rank_zero0=false: training runs ZeRO 1-2 on one rank as
ZeRO-0, which this bench would otherwise measure twice); ``--profile`` runs bench/train_step_profile.py instead.

The batch is one real batch of the demo pretraining shards (augmented, tokenized), reused every step, so data
loading is excluded. step_seconds = median over the timed steps of rank 0's wall time (every ZeRO step ends in a
collective, so ranks finish together); one thread per rank; samples_per_s = batch_per_rank x ranks / step_seconds. peak_rss_mb: the
highest resident set size sampled every 2 ms during the timed steps, max over ranks (CPU has no allocator peak
counter; RSS includes the Python process, DeepSpeed and the model, and what earlier cases of the same process
left: rss_at_start_mb is the RSS when the case's timed steps began). state_*_bytes: per-rank training state
measured from the engine's tensors (bench/zero_memory.py), max over ranks.
Rows: preset, ranks, zero_stage, grad_checkpointing, batch_per_rank, step_seconds, samples_per_s, peak_rss_mb,
state_parameters_bytes, state_gradients_bytes, state_optimizer_bytes, state_other_bytes, state_total_bytes,
state_total_vs_zero0, zero_paper_mixed_precision_bytes (the ZeRO paper's per-rank figure for the same trainable
parameter count in bf16/fp32 mixed precision, for reference), rss_at_start_mb, parameters, trainable_parameters,
timed_steps, flops_per_sample (train/flops.py, the analytic model FLOPs of one sample of this batch),
matmul_peak_flops (a 1-thread fp32 1024x1024 matmul's FLOP/s measured on rank 0 just before the case: a CPU has
no datasheet bf16 peak, so this measured rate stands in for it) and mfu (flops_per_sample x samples_per_s per
rank / matmul_peak_flops).

On a machine with CUDA the bench runs bench/train_step_gpu.py instead (bf16, base and large, largest batch).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from mplug_pretrain.bench.common import pretrain_batch, write_bench
from mplug_pretrain.utils import process_group
from mplug_pretrain.utils.atomic_files import write_json_atomic

# per preset: (batch per rank, warm-up steps, timed steps); "quick" is the test suite's tiny setting
SETTINGS = {"tiny": (16, 1, 3), "base": (2, 1, 2), "quick": (4, 0, 1)}


class RssPeak:
    """Highest resident set size (MB) seen by a sampling thread between start() and stop()."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = self.start_mb = self._rss()
        self.start_mb /= 2**20
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak, self._rss()) / 2**20


def zero_paper_bytes(trainable: int, stage: int, ranks: int) -> int:
    """Per-rank model states of mixed-precision Adam in the ZeRO paper (§5, K = 12): 2Ψ bf16 parameters, 2Ψ bf16
    gradients, 12Ψ fp32 master + moments; stage 1 partitions the 12Ψ, stage 2 also the gradients, stage 3 all."""
    psi, k = trainable, ranks
    return int({0: 16 * psi, 1: 4 * psi + 12 * psi / k, 2: 2 * psi + 14 * psi / k, 3: 16 * psi / k}[stage])


def matmul_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an fp32 n x n matmul on this process's threads (median of ``repeats``)."""
    import torch
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2.0 * n ** 3 / statistics.median(times)


def _case(setting: str, stage: int, checkpointing: bool, world: int, batch: dict) -> dict:
    import torch
    import torch.distributed as dist

    from mplug_pretrain.bench.zero_memory import state_bytes
    from mplug_pretrain.config import load_config
    from mplug_pretrain.tasks.pretrain.train import build_model, flops_per_sample
    from mplug_pretrain.train.engine import build_engine
    from mplug_pretrain.train.flops import mfu
    preset = "tiny" if setting == "quick" else setting
    batch_size, warmup, timed = SETTINGS[setting]
    cfg = load_config(None, [f"model.preset={preset}", f"data.batch_size={batch_size}",
                             f"distributed.zero_stage={stage}", "distributed.precision=fp32",
                             f"model.grad_checkpointing={str(checkpointing).lower()}",
                             # the stage as written, on one rank too: this bench compares the stages' state
                             "distributed.single_rank_zero0=false",
                             "optim.warmup_steps=1", "optim.max_steps=100"], check_paths=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine, _, _ = build_engine(model, cfg, world)

    def step(measure_state: bool = False) -> dict | None:
        loss = engine(batch)["loss"]
        engine.backward(loss)
        held = state_bytes(engine) if measure_state else None
        engine.step()
        return held

    for _ in range(warmup):
        step()
    peak = matmul_peak_flops()
    times = []
    with RssPeak() as rss:
        for _ in range(timed):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    held = step(measure_state=True)
    keys = ("parameters", "gradients", "optimizer_state", "other", "total")
    gathered = torch.tensor([rss.peak_mb, rss.start_mb] + [float(held[k]) for k in keys], dtype=torch.float64)
    if process_group.world_size() > 1:
        dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
    step_seconds = statistics.median(times)
    row = {"preset": preset, "ranks": world, "zero_stage": stage, "grad_checkpointing": checkpointing,
           "batch_per_rank": batch_size, "step_seconds": step_seconds,
           "samples_per_s": batch_size * world / step_seconds, "peak_rss_mb": gathered[0].item(),
           "rss_at_start_mb": gathered[1].item(),
           **{f"state_{k.replace('optimizer_state', 'optimizer')}_bytes": int(gathered[i + 2].item())
              for i, k in enumerate(keys)},
           "zero_paper_mixed_precision_bytes": zero_paper_bytes(trainable, stage, world),
           "parameters": n_params, "trainable_parameters": trainable, "timed_steps": timed}
    row["flops_per_sample"] = flops_per_sample(cfg, batch)
    row["matmul_peak_flops"] = peak
    row["mfu"] = mfu(row["flops_per_sample"], batch_size / step_seconds, peak)
    return row


def worker(cases: list[list], out: str) -> None:
    """Runs inside torchrun: every case in this process (stage 3 last: it hooks the model it wraps)."""
    from mplug_pretrain.train.distributed import init_distributed, shutdown_distributed
    info = init_distributed("gloo", timeout_minutes=10)
    batches: dict[str, dict] = {}
    rows = []
    for setting, stage, checkpointing in cases:
        if setting not in batches:
            batches[setting] = pretrain_batch("tiny" if setting == "quick" else setting, SETTINGS[setting][0])
        rows.append(_case(setting, stage, checkpointing, info.world_size, batches[setting]))
        gc.collect()  # the case's engine and model are unreachable now
        if info.rank == 0:
            r = rows[-1]
            print(f"[train-step] {setting} ranks={r['ranks']} zero={stage} ckpt={checkpointing}: "
                  f"{r['step_seconds']:.3f} s/step, {r['samples_per_s']:.1f} samples/s, "
                  f"MFU {100 * r['mfu']:.1f}% of a 1-thread matmul", flush=True)
    if info.rank == 0:
        write_json_atomic(out, rows, indent=None)
    process_group.barrier()
    shutdown_distributed()


def _launch(world: int, cases: list[tuple], timeout: float) -> list[dict]:
    from mplug_pretrain.config import REPO_ROOT
    # one thread per rank: 2 ranks then have twice the compute of 1, and a rank's step does not stall on a
    # second thread that other jobs on a shared machine have preempted
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO_ROOT, ".cache", "torch_extensions"))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "mplug_pretrain.bench.train_step", "--ranks", str(world),
               "--worker", json.dumps(cases), "--rows", out]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"train-step worker ({world} ranks) failed:\n{proc.stderr[-4000:]}")
        print(proc.stdout, end="", flush=True)
        with open(out) as f:
            return json.load(f)


def run(out: str, quick: bool = False, base: bool = True, profile: bool = False) -> dict:
    """quick=True (test suite): tiny preset at batch 4, 2 ranks, ZeRO 0 and 3, one timed step.
    Full: tiny x {1, 2 ranks} x ZeRO {0,1,2,3} x checkpointing {off, on}; base at batch 2 per rank,
    1 rank, ZeRO 2 (the default stage), checkpointing off and on (2 timed steps: on 2 CPU cores a base step is slow).
    profile=True (``--profile``): bench/train_step_profile.py on the CPU, the GPU bench with its profile on CUDA."""
    import torch
    if torch.cuda.is_available():
        from mplug_pretrain.bench.train_step_gpu import run as run_gpu
        if profile:
            os.environ["MPLUG_BENCH_GPU_PROFILE"] = "1"
        return run_gpu(out, quick=quick)
    if profile:
        from mplug_pretrain.bench.train_step_profile import run as run_profile
        return run_profile(out, quick=quick)
    rows, load_before = [], os.getloadavg()
    if quick:
        rows += _launch(2, [("quick", 0, False), ("quick", 3, False)], timeout=300)
    else:
        tiny = [("tiny", s, c) for s in (0, 1, 2, 3) for c in (False, True)]
        for world in (1, 2):
            rows += _launch(world, tiny, timeout=900)
        if base:
            rows += _launch(1, [("base", 2, c) for c in (False, True)], timeout=900)
    for row in rows:
        zero0 = next((r for r in rows if r["preset"] == row["preset"] and r["ranks"] == row["ranks"]
                      and r["zero_stage"] == 0 and r["grad_checkpointing"] == row["grad_checkpointing"]), None)
        row["state_total_vs_zero0"] = row["state_total_bytes"] / zero0["state_total_bytes"] if zero0 else None
    return write_bench("train_step", rows, out, quick=quick, precision="fp32", device="cpu", threads_per_rank=1,
                       load_average_before=load_before, load_average_after=os.getloadavg(),
                       note="DeepSpeed fp32 ZeRO 1-3 keep a separate fp32 master partition next to the module's "
                            "fp32 parameters, so fp32 ZeRO-1/2 hold more state than ZeRO-0 at 1 rank")


def main(argv: list[str]) -> int:
    """``--ranks N``: start N ranks running ``--worker`` (forked from this process, or under torchrun where they
    cannot be: a GPU, another OS); without it this process is one of them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, help="JSON list of [setting, zero_stage, checkpointing]")
    parser.add_argument("--rows", required=True)
    parser.add_argument("--ranks", type=int, default=None, help="start this many ranks")
    args = parser.parse_args(argv)
    if args.ranks is None:
        worker(json.loads(args.worker), args.rows)
        return 0
    from mplug_pretrain.train.distributed import free_port
    from mplug_pretrain.utils.fork_launch import fork_ranks, prepare_fork
    if prepare_fork() is None:
        return fork_ranks(args.ranks, lambda: main(["--worker", args.worker, "--rows", args.rows]), free_port())
    from torch.distributed.run import main as torchrun
    torchrun(["--nproc_per_node", str(args.ranks), "--standalone", "-m", "mplug_pretrain.bench.train_step",
              "--worker", args.worker, "--rows", args.rows])  # raises if a rank fails
    return 0


if __name__ == "__main__":
    from mplug_pretrain.utils.fast_exit import exit_now
    exit_now(main(sys.argv[1:]))
