"""`mplug bench train-step --profile`: where one pretraining step's time goes, and CPU-countable proxies of its
GPU costs, through the real single-process DeepSpeed engine (train/engine.py) on one demo batch.

Per case (preset, ZeRO stage, precision, run.compile, checkpointing mode) a row with the step's wall time in
buckets (bench/step_profile.py: matmul / attention / elementwise / optimizer / idle, seconds and shares of
one profiled step after warm-up), and, for eager cases, the op counts (bench/step_proxies.py: dispatched ops
per step and per block call by kind, dtype casts of non-parameter tensors). The JSON also holds the host syncs
of whole optimizer steps through the training loop, log steps apart (bench/host_syncs.py).
On the CPU the timed cases are fp32 (bf16 runs 2-3x slower there, without bf16 hardware) and the cast count is
taken in bf16 (autocast's casts are what the GPU run pays); ``MPLUG_BENCH_PROFILE_COMPILE=1`` adds a compiled
(inductor) case, whose code generation takes minutes on 2 cores.

    mplug bench train-step --profile --out bench/results/train_step_profile.json [--quick]
"""
from __future__ import annotations

import os

# preset -> (batch, warm-up steps)
SETTINGS = {"tiny": (16, 2), "quick": (4, 1)}


def _engine(preset: str, batch_size: int, stage: int, precision: str, compile_: bool, checkpointing):
    import torch

    from mplug_pretrain.config import load_config
    from mplug_pretrain.tasks.pretrain.train import build_model
    from mplug_pretrain.train.engine import build_engine
    cfg = load_config(None, [f"model.preset={preset}", f"data.batch_size={batch_size}",
                             f"distributed.zero_stage={stage}", f"distributed.precision={precision}",
                             f"model.grad_checkpointing={str(checkpointing).lower()}",
                             f"run.compile={str(compile_).lower()}", "optim.warmup_steps=1",
                             "optim.max_steps=100"], check_paths=False)
    torch.manual_seed(0)
    engine, _, ds_config = build_engine(build_model(cfg), cfg, 1)
    return engine, ds_config["zero_optimization"]["stage"]


def step_function(engine, batch: dict, stage: int):
    """One training step as the loop runs it; the optimizer step and the momentum update inside a profiler range
    named ``optimizer.step`` (bench/step_profile.py counts what runs there as optimizer time)."""
    from torch.profiler import record_function

    from mplug_pretrain.train.engine import after_optimizer_step

    def step() -> None:
        loss = engine(batch)["loss"]
        engine.module.commit_enqueue()
        engine.backward(loss)
        with record_function("optimizer.step (DeepSpeed engine.step + momentum update)"):
            engine.step()
            after_optimizer_step(engine, stage)
    return step


def profile_case(preset: str, batch: dict, stage: int = 2, precision: str = "fp32", compile_: bool = False,
                 checkpointing=False, warmup: int = 2, count_ops: bool = True) -> dict:
    """One case's row (module docstring)."""
    import torch

    from mplug_pretrain.bench.step_profile import profile_step
    from mplug_pretrain.bench.step_proxies import count_step_ops
    from mplug_pretrain.train.block_compile import pad_text
    engine, engine_stage = _engine(preset, batch["input_ids"].shape[0], stage, precision, compile_, checkpointing)
    batch = {k: v.to(engine.device) if isinstance(v, torch.Tensor) and k != "is_pad" else v for k, v in batch.items()}
    if compile_:
        batch = pad_text(batch)
    step = step_function(engine, batch, stage)
    for _ in range(warmup):
        step()
    device = torch.device(engine.device).type
    row = {"preset": preset, "zero_stage": stage, "engine_zero_stage": engine_stage, "precision": precision, "compile": compile_,
           "grad_checkpointing": checkpointing, "batch_per_rank": batch["input_ids"].shape[0],
           "text_tokens": batch["input_ids"].shape[1], "device": device, **profile_step(step, device)}
    if count_ops and not compile_:  # a dispatch mode around compiled code would count dynamo's tracing instead
        row.update(count_step_ops(engine.module, step))
    return row


def run(out: str, quick: bool = False) -> dict:
    """CPU: tiny ZeRO-2 fp32 (timed) and bf16 (casts), eager; + compiled with MPLUG_BENCH_PROFILE_COMPILE=1."""
    import torch

    from mplug_pretrain.bench.common import pretrain_batch, write_bench
    from mplug_pretrain.bench.host_syncs import count_optimizer_step_syncs, init_single_process
    threads = int(os.environ.get("MPLUG_BENCH_THREADS", "2"))
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    init_single_process()
    setting = "quick" if quick else "tiny"
    batch_size, warmup = SETTINGS[setting]
    batch = pretrain_batch("tiny", batch_size)
    cases = [{"precision": "fp32"}, {"precision": "bf16"}]
    if os.environ.get("MPLUG_BENCH_PROFILE_COMPILE") == "1":
        cases.append({"precision": "fp32", "compile_": True})
    rows = []
    for case in cases:
        rows.append(profile_case("tiny", batch, warmup=warmup, **case))
        print(f"[train-step profile] {rows[-1]}", flush=True)
    syncs = count_optimizer_step_syncs(steps=3 if quick else 6, log_every=3)
    return write_bench("train_step_profile", rows, out, quick=quick, threads=threads, host_syncs=syncs,
                       load_average_before=load_before, load_average_after=os.getloadavg())
