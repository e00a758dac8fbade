"""Host syncs per pretraining micro-step, counted on the CPU (utils/host_syncs.HostSyncCounter).

One real micro-step of the loop (train/loop._micro_step: forward of all four losses, the all-rank finiteness
flag, backward, DeepSpeed step) plus the momentum update, through a real single-process DeepSpeed engine
on the embedded demo shards. The per-optimizer-step log record (its loss read-out and the checkpoint-due flag)
is not counted: it is the logging step. Warm-up micro-steps first (the queue fills, one-off setup syncs).
``count_optimizer_step_syncs`` counts whole optimizer steps through the loop instead, log steps included
(``mplug bench train-step --profile`` writes it).

    python -m mplug_pretrain.bench.host_syncs [--precision bf16] [--steps 3] [--sites]
"""
from __future__ import annotations

import json
import os


def init_single_process() -> None:
    """torch.distributed (gloo) for this one process, on a free port unless MASTER_PORT is set."""
    from mplug_pretrain.train.distributed import free_port, init_distributed
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_distributed("gloo", 5)


def _demo_run(overrides: list[str]):
    """(cfg, engine, bare loop run, batch iterator): a single-process ZeRO-2 tiny run on the demo shards."""
    import torch

    from mplug_pretrain.config import load_config
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.demo.shards import ensure_demo_shards
    from mplug_pretrain.tasks.pretrain.train import build_model, build_train_loader
    from mplug_pretrain.train.engine import build_engine
    from mplug_pretrain.train.loop import TrainTask, bare_run

    init_single_process()
    shards = ensure_demo_shards()["pretrain_train"]
    cfg = load_config(None, ["model.preset=tiny", f"data.train_shards={shards}", "data.batch_size=4",
                             "data.num_workers=0", "model.heads.queue_size=32", "optim.warmup_steps=1",
                             "distributed.zero_stage=2", *overrides])
    torch.manual_seed(0)
    engine, optimizer, _ = build_engine(build_model(cfg), cfg, 1)
    task = TrainTask("pretrain", build_model, build_train_loader,
                     lambda module, batch, state: module(batch, alpha=0.4))
    run = bare_run(cfg, task, engine, optimizer)
    shard_loader = build_train_loader(cfg, LoaderSpec(shards, cfg.data.batch_size, 0, rank=0, world_size=1))
    run.image_normalize = shard_loader.image_normalize  # uint8 images, normalised in _micro_step as in the loop
    loader = iter(shard_loader)
    return cfg, engine, run, loader


def count_micro_step_syncs(overrides: list[str] | None = None, warmup: int = 2, steps: int = 3,
                           stack_depth: int = 0) -> dict:
    """-> {"per_micro_step": [syncs of each counted micro-step], "ours_per_micro_step": [those our code asked
    for], "by_op": {...}, "by_source": {...}, "sites": {...}} (utils/host_syncs.HostSyncCounter)."""
    from mplug_pretrain.train.engine import after_optimizer_step
    from mplug_pretrain.train.loop import _micro_step
    from mplug_pretrain.utils.host_syncs import HostSyncCounter

    cfg, engine, run, loader = _demo_run(overrides or [])
    counts, ours, totals = [], [], {"by_op": {}, "by_source": {}, "sites": {}}
    for i in range(warmup + steps):
        batch = next(loader)
        with HostSyncCounter(stack_depth, count_tolist=True) as counter:
            result = _micro_step(run, batch)
            if result is not None and result[1]:
                after_optimizer_step(engine, cfg.distributed.zero_stage)
        run.losses_accum = {}  # the log step's read-out, not counted
        run.micro = 0
        run.state.global_step += 1
        if i >= warmup:
            counts.append(counter.total)
            ours.append(counter.by_source["ours"])
            _add_counts(totals, counter)
    return {"per_micro_step": counts, "ours_per_micro_step": ours, **totals}


def _add_counts(totals: dict, counter) -> None:
    for name, total in totals.items():
        for k, v in getattr(counter, name).items():
            total[k] = total.get(k, 0) + v


def count_optimizer_step_syncs(overrides: list[str] | None = None, warmup: int = 1, steps: int = 6,
                               log_every: int = 3, stack_depth: int = 3) -> dict:
    """Host syncs of whole optimizer steps through the loop (``_micro_step`` + ``_finish_step``: momentum update,
    log record, checkpoint-due flag), ``Tensor.tolist`` reads included, with ``run.log_every=log_every``.
    -> {"log_every", "ours_per_step", "deepspeed_per_step", "log_step": [bool per step], "ours_outside_log_steps_max",
    "by_op", "by_source", "sites"}."""
    import time

    from mplug_pretrain.train.loop import _finish_step, _micro_step
    from mplug_pretrain.train.signals import StopRequest
    from mplug_pretrain.utils.host_syncs import HostSyncCounter

    _, _, run, loader = _demo_run([f"run.log_every={log_every}", "optim.max_steps=1000", *(overrides or [])])
    run.stop, run.last_ckpt_time = StopRequest(), time.time()
    ours, theirs, log_steps, totals = [], [], [], {"by_op": {}, "by_source": {}, "sites": {}}
    for i in range(warmup + steps):
        batch = next(loader)
        with HostSyncCounter(stack_depth, count_tolist=True) as counter:
            result = _micro_step(run, batch)
            if result is not None and result[1]:
                _finish_step(run, result[0], 0.0, 1.0)
        if i >= warmup:
            ours.append(counter.by_source["ours"])
            theirs.append(counter.by_source["deepspeed"])
            log_steps.append(run.state.global_step % log_every == 0)
            _add_counts(totals, counter)
    outside = [n for n, logged in zip(ours, log_steps) if not logged]
    return {"log_every": log_every, "ours_per_step": ours, "deepspeed_per_step": theirs, "log_step": log_steps,
            "ours_outside_log_steps_max": max(outside) if outside else None, **totals}


def main() -> None:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sites", action="store_true", help="also list where the syncs come from")
    args = parser.parse_args()
    result = count_micro_step_syncs([f"distributed.precision={args.precision}"], steps=args.steps,
                                    stack_depth=3 if args.sites else 0)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
