"""`mplug bench train-step` on a CUDA machine: one pretraining step (all four losses, forward + backward +
fused AdamW) through the real DeepSpeed engine in bf16 (DeepSpeed's torch_autocast mode: fp32 parameters, bf16 compute), one GPU (torchrun, nccl),
for the base and large presets x ZeRO {0, 2, 3} x gradient checkpointing {off, on}, each at the largest batch
that fits: the batch doubles from ``START_BATCH`` until ``torch.cuda.OutOfMemoryError`` (or ``MAX_BATCH``).

Rows: preset, zero_stage, grad_checkpointing, batch_per_rank (largest that fit), step_seconds (median of the
timed steps, synchronized), samples_per_s, peak_gpu_memory_mb (torch.cuda.max_memory_allocated over the timed
steps), flops_per_sample (train/flops.py: analytic model FLOPs, typical MLM/PrefixLM shapes, full queue),
mfu (flops_per_sample x samples_per_s / the GPU's dense bf16 peak, train/flops.PEAK_BF16_FLOPS),
tried_batches, oom_at (the first batch that did not fit, None when MAX_BATCH fitted).
The batch is one real demo batch at the preset's resolution (256 px base, 224 px large), tiled to the batch
size, its text padded to the ``TEXT_TOKENS`` = 30 tokens the FLOP count assumes, so data loading is excluded
(see `mplug bench dataloader` for how many workers feed one GPU). The ITC queues are filled before the
warm-up steps (the FLOP count, memory and largest batch are those of a full queue). Each case runs in a
process of its own, so a CUDA error other than running out of memory loses that case only.
Written to bench/results/train_step_gpu.json by default.
A GPU lease is short: ``MPLUG_BENCH_GPU_CASES`` picks the cases, ``preset:stage:checkpointing[:compile[:zero]]``
with checkpointing off | on | selective, compile eager | compiled (run.compile: per-block torch.compile, text
padded to a multiple of 8; the FLOP count stays that of the 30 tokens) and zero single (default: ZeRO 1-2 on one
GPU run as ZeRO-0, distributed.single_rank_zero0) | keep (the stage as written); ``MPLUG_BENCH_GPU_START_BATCH``
/ ``MPLUG_BENCH_GPU_MAX_BATCH`` bound the doubling (equal: one batch, no search: a compiled case compiles again
at every batch size); ``MPLUG_BENCH_GPU_PROFILE=1`` adds one profiled step's buckets to each row (``profile_*``:
bench/step_profile.py); ``MPLUG_BENCH_GPU_CASE_TIMEOUT`` (seconds) ends a case that runs longer, recorded as
failed. A case that fails (a compile error, a timeout, a CUDA error) keeps its row with ``error`` and the
others run. The lease script (<= 8 min on an H100, base ZeRO-2 eager vs compiled with the profile, large
ZeRO-2, base ZeRO-3, and base ZeRO-2 kept partitioned for the before/after):

    MPLUG_BENCH_GPU_START_BATCH=128 MPLUG_BENCH_GPU_MAX_BATCH=128 MPLUG_BENCH_GPU_PROFILE=1 \
    MPLUG_BENCH_GPU_CASE_TIMEOUT=150 \
    MPLUG_BENCH_GPU_CASES=base:2:off:eager:keep,base:2:off:eager,base:2:off:compiled,large:2:off:eager,base:3:off:eager \
    mplug bench train-step --out bench/results/train_step_gpu_issue35.json
"""
from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from mplug_pretrain.bench.common import pretrain_batch, write_bench
from mplug_pretrain.utils.atomic_files import write_json_atomic

START_BATCH, MAX_BATCH = 8, 1024
TEXT_TOKENS = 30  # the text length train/flops.py counts (data.max_text_len of the pretraining configs)
WARMUP_STEPS, TIMED_STEPS = 3, 10
CASES = [(preset, stage, ckpt) for preset in ("base", "large") for stage in (0, 2, 3) for ckpt in (False, True)]


def _tiled_batch(preset: str, batch_size: int, device) -> dict:
    import torch.nn.functional as F
    one = pretrain_batch(preset, 16)
    for key in ("input_ids", "attention_mask"):  # right padding ([PAD] = 0, mask 0) up to TEXT_TOKENS
        one[key] = F.pad(one[key], (0, TEXT_TOKENS - one[key].shape[1]))
    reps = -(-batch_size // 16)
    out = {}
    for key, value in one.items():
        if key == "is_pad":
            out[key] = value.repeat(reps)[:batch_size]  # read on the host, as the training loop keeps it
        elif hasattr(value, "repeat"):
            value = value.repeat(reps, *([1] * (value.ndim - 1)))[:batch_size].to(device)
            if key == "image_id":  # distinct ids: the tiled copies are not positives of each other
                import torch
                value = torch.arange(batch_size, device=device)
        out[key] = value
    return out


def measure_case(preset: str, stage: int, checkpointing, batch_size: int, compile_: bool = False,
                 single_rank_zero0: bool = True) -> dict:
    """One (preset, stage, checkpointing, batch) on this GPU; raises torch.cuda.OutOfMemoryError when it does not fit."""
    import torch

    from mplug_pretrain.bench.step_profile import profile_step
    from mplug_pretrain.bench.train_step_profile import step_function
    from mplug_pretrain.config import load_config
    from mplug_pretrain.tasks.pretrain.train import build_model, flops_per_sample
    from mplug_pretrain.train.block_compile import pad_text
    from mplug_pretrain.train.engine import build_engine
    from mplug_pretrain.train.flops import current_peak_flops, mfu
    cfg = load_config(None, [f"model.preset={preset}", f"data.batch_size={batch_size}",
                             f"distributed.zero_stage={stage}", "distributed.precision=bf16",
                             f"model.grad_checkpointing={str(checkpointing).lower()}",
                             f"run.compile={str(compile_).lower()}",
                             f"distributed.single_rank_zero0={str(single_rank_zero0).lower()}",
                             "optim.warmup_steps=1", "optim.max_steps=100"], check_paths=False)
    torch.manual_seed(0)
    engine = None
    try:
        engine, _, ds_config = build_engine(build_model(cfg), cfg, 1)
        counted = _tiled_batch(preset, batch_size, engine.device)
        batch = pad_text(counted) if compile_ else counted
        _fill_queues(engine.module)
        step = step_function(engine, batch, stage)  # forward, the loop's enqueue, backward, step + momentum

        for _ in range(WARMUP_STEPS):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(TIMED_STEPS):
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        flops = flops_per_sample(cfg, counted)
        row = {"preset": preset, "zero_stage": stage, "grad_checkpointing": checkpointing, "compile": compile_,
               "engine_zero_stage": ds_config["zero_optimization"]["stage"],
               "batch_per_rank": batch_size, "step_seconds": seconds, "samples_per_s": batch_size / seconds,
               "peak_gpu_memory_mb": torch.cuda.max_memory_allocated() / 2**20, "flops_per_sample": flops,
               "mfu": mfu(flops, batch_size / seconds, current_peak_flops(engine.device)),
               "timed_steps": TIMED_STEPS}
        if os.environ.get("MPLUG_BENCH_GPU_PROFILE") == "1":
            row.update({f"profile_{k}": v for k, v in profile_step(step, "cuda").items()})
        return row
    finally:
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()
        engine = None
        gc.collect()
        torch.cuda.empty_cache()


def _fill_queues(module) -> None:
    """ITC queues full of unit-norm features with distinct ids (as after the first Q / batch steps)."""
    import torch
    itc = module.itc
    with torch.no_grad():
        for queue in (itc.image_queue, itc.text_queue):
            queue.copy_(torch.nn.functional.normalize(torch.randn_like(queue), dim=0))
        itc.idx_queue.copy_(torch.arange(itc.queue_size, device=itc.idx_queue.device) + 10**9)
        itc.queue_count.fill_(itc.queue_size)
        itc.queue_ptr.zero_()


def largest_batch(preset: str, stage: int, checkpointing: bool, start: int = START_BATCH,
                  limit: int = MAX_BATCH, measure=measure_case) -> dict | None:
    """Double the batch from ``start`` until it runs out of GPU memory; -> the row of the largest that fit
    (with tried_batches and oom_at), None when not even ``start`` fits."""
    import torch
    best, tried, oom_at, batch = None, [], None, start
    while batch <= limit:
        tried.append(batch)
        try:
            best = measure(preset, stage, checkpointing, batch)
        except torch.cuda.OutOfMemoryError:
            oom_at = batch
            break
        batch *= 2
    if best is not None:
        best.update(tried_batches=tried, oom_at=oom_at)
    return best


def case_row(case, start: int, limit: int, measure=measure_case) -> dict:
    """The row of one case (largest batch in [start, limit]); a failure other than running out of memory (a
    compile error, a CUDA error raised as an exception) becomes the row's ``error``."""
    preset, stage, ckpt, *options = case
    compile_, single = options if options else (False, True)
    try:
        row = largest_batch(preset, stage, ckpt, start=start, limit=limit,
                            measure=functools.partial(measure, compile_=compile_, single_rank_zero0=single))
    except Exception as err:  # noqa: BLE001 (recorded: the lease goes on with the next case)
        return {"preset": preset, "zero_stage": stage, "grad_checkpointing": ckpt, "compile": compile_,
                "error": f"{type(err).__name__}: {str(err)[-2000:]}"}
    if row is None:
        row = {"preset": preset, "zero_stage": stage, "grad_checkpointing": ckpt, "batch_per_rank": 0,
               "oom_at": start}
    return row


def worker(cases: list, out: str) -> None:
    import torch

    from mplug_pretrain.train.distributed import init_distributed, shutdown_distributed
    init_distributed("nccl", timeout_minutes=30)
    rows = []
    start = int(os.environ.get("MPLUG_BENCH_GPU_START_BATCH", START_BATCH))
    limit = int(os.environ.get("MPLUG_BENCH_GPU_MAX_BATCH", MAX_BATCH))
    for case in cases:
        row = case_row(case, start, limit)
        rows.append(row)
        print(f"[train-step gpu] {json.dumps(row)}", flush=True)
        write_json_atomic(out, rows, indent=None)  # partial results survive a later failure
    torch.cuda.synchronize()
    shutdown_distributed()


CHECKPOINTING = {"off": False, "on": True, "selective": "selective"}
COMPILE = {"eager": False, "compiled": True}
ZERO = {"single": True, "keep": False}


def cases_from_env(value: str | None) -> list[tuple] | None:
    """``MPLUG_BENCH_GPU_CASES``: "preset:stage:off|on|selective[:eager|compiled[:single|keep]],..." ->
    [(preset, stage, checkpointing)] or, with the options, [(preset, stage, checkpointing, compile,
    single_rank_zero0)]; None if unset."""
    if not value:
        return None
    cases = []
    for item in value.split(","):
        preset, stage, ckpt, *options = item.strip().split(":")
        if ckpt not in CHECKPOINTING:
            raise ValueError(f"MPLUG_BENCH_GPU_CASES: {item!r}: checkpointing must be off, on or selective")
        if len(options) > 2 or (options and options[0] not in COMPILE) or (len(options) == 2 and options[1] not in ZERO):
            raise ValueError(f"MPLUG_BENCH_GPU_CASES: {item!r}: after the checkpointing, eager|compiled and then "
                             "single|keep")
        case = (preset, int(stage), CHECKPOINTING[ckpt])
        if options:
            case += (COMPILE[options[0]], ZERO[options[1]] if len(options) == 2 else True)
        cases.append(case)
    return cases


def run(out: str, quick: bool = False) -> dict:
    """quick: base preset, ZeRO 2, checkpointing off only."""
    from mplug_pretrain.config import REPO_ROOT
    cases = [("base", 2, False)] if quick else (cases_from_env(os.environ.get("MPLUG_BENCH_GPU_CASES")) or CASES)
    timeout = float(os.environ["MPLUG_BENCH_GPU_CASE_TIMEOUT"]) if os.environ.get("MPLUG_BENCH_GPU_CASE_TIMEOUT") else None
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO_ROOT, ".cache", "torch_extensions"))
    rows, failed, errors = [], [], []
    for case in cases:  # one process per case: a CUDA error loses that case, not the rest
        with tempfile.TemporaryDirectory() as tmp:
            rows_file = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--standalone",
                   "-m", "mplug_pretrain.bench.train_step_gpu", "--worker", json.dumps([case]), "--rows", rows_file]
            try:
                proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False,
                                      timeout=timeout)
            except subprocess.TimeoutExpired as expired:
                proc = subprocess.CompletedProcess(cmd, -1, expired.stdout or "", f"timed out after {timeout} s")
                if isinstance(proc.stdout, bytes):
                    proc.stdout = proc.stdout.decode(errors="replace")
            print(proc.stdout, end="", flush=True)
            if os.path.exists(rows_file):
                with open(rows_file) as f:
                    rows += json.load(f)
            if proc.returncode != 0:
                failed.append(list(case))
                errors.append({"case": list(case), "error": proc.stderr[-2000:]})
                print(f"[train-step gpu] case {case} failed:\n{proc.stderr[-4000:]}", flush=True)
    return write_bench("train_step_gpu", rows, out, quick=quick, precision="bf16", device="cuda",
                       start_batch=int(os.environ.get("MPLUG_BENCH_GPU_START_BATCH", START_BATCH)),
                       max_batch=MAX_BATCH, warmup_steps=WARMUP_STEPS,
                       text_tokens=TEXT_TOKENS, complete=not failed and not any("error" in r for r in rows), failed_cases=failed, failures=errors)


def main() -> None:
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--rows", required=True)
    args = parser.parse_args()
    worker(json.loads(args.worker), args.rows)


if __name__ == "__main__":
    main()
