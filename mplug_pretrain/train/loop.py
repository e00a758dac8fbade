"""The training loop every task shares (pretraining, caption XE/SCST, VQA): one batch goes
loader -> ``task.losses(module, batch, state)`` -> DeepSpeed backward/step -> our LR schedule ->
momentum update (when the model has momentum encoders) -> log -> checkpoint.

A task supplies the model, the loader for (epoch, start batch) and the loss computation; the loop
owns DeepSpeed, exact resume, non-finite skipping, signals, logging and the final model folder."""
from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mplug_pretrain.config import Config, save_config
from mplug_pretrain.train.checkpoint import TrainerState, load_checkpoint, resolve_resume, save_checkpoint
from mplug_pretrain.train.distributed import init_distributed
from mplug_pretrain.train.engine import autocast_context, build_engine, momentum_update, save_final_model
from mplug_pretrain.train.run_log import RunLog, peak_memory_mb, plot_losses, truncate_log
from mplug_pretrain.train.schedule import apply_lr
from mplug_pretrain.train.signals import StopRequest

PREEMPTED_MARKER = "preempted"


class NonFiniteLossError(RuntimeError):
    pass


def _record_world(run_dir: str, info) -> None:
    """<run>/world.json: which host each rank runs on (rank 0 writes it; appended per (re)start)."""
    import json
    import socket
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # Slurm's node name, else the host
    hosts = [None] * info.world_size
    if dist.is_initialized() and info.world_size > 1:
        dist.all_gather_object(hosts, host)
    else:
        hosts = [host]
    if info.rank == 0:
        with open(os.path.join(run_dir, "world.json"), "a") as f:
            f.write(json.dumps({"world_size": info.world_size, "launcher": info.launcher, "hosts": hosts,
                                "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT")}) + "\n")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class TrainTask:
    """What a task plugs into the loop.

    build_model(cfg) -> nn.Module (with param_groups / set_grad_checkpointing / save_pretrained)
    make_loader(cfg, rank, world_size, epoch, start_batch) -> iterable of batch dicts (deterministic
        for a given epoch; ``start_batch`` skips the batches already consumed)
    losses(module, batch, state) -> {"loss": scalar to optimise, "loss_*": scalars to log}
    """
    name: str
    build_model: Callable[[Config], torch.nn.Module]
    make_loader: Callable[..., Iterable[dict]]
    losses: Callable[[torch.nn.Module, dict, TrainerState], dict]


def _to_device(batch: dict, device, float_dtype=None) -> dict:
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            value = value.to(device, non_blocking=True)
            if float_dtype is not None and value.is_floating_point():
                value = value.to(float_dtype)
        out[key] = value
    return out


def _all_ranks_max(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_training(cfg: Config, task: TrainTask, resume: str | None = None) -> dict:
    """Train until ``optim.max_steps`` optimizer steps (or a stop signal). Returns a summary."""
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_minutes)
    rank, world = info.rank, info.world_size
    run_dir = cfg.run_dir
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        save_config(cfg, os.path.join(run_dir, "config.yaml"))
        marker = os.path.join(run_dir, PREEMPTED_MARKER)
        if os.path.exists(marker):
            os.remove(marker)
    _record_world(run_dir, info)
    seed_everything(cfg.run.seed + rank)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)

    model = task.build_model(cfg)
    engine, optimizer, _ = build_engine(model, cfg, world)
    device = engine.device
    float_dtype = torch.bfloat16 if engine.bfloat16_enabled() else None

    state = TrainerState()
    tag = resolve_resume(resume, ckpt_dir)
    if tag is not None:
        state = load_checkpoint(engine, ckpt_dir, tag, rank)
        if rank == 0:
            truncate_log(run_dir, state.global_step)
    stop = StopRequest().install()
    o = cfg.optim
    log = RunLog(run_dir, o.max_steps, enabled=rank == 0, tensorboard=cfg.run.tensorboard,
                 print_every=cfg.run.log_every, initial_step=state.global_step)
    if tag is not None:
        log.event(f"[train] resumed from {tag}: step {state.global_step}, samples {state.samples_seen}, "
                  f"epoch {state.epoch} batch {state.batch_in_epoch}")
    samples_per_step = cfg.data.batch_size * o.grad_accum_steps * world
    nan_steps = set(cfg.run.inject_nonfinite_at_steps)
    last_ckpt_time = time.time()
    in_a_row = 0
    exit_reason = "finished"
    losses_accum: dict[str, float] = {}
    micro = 0

    loader = None  # stays None when a resumed run had already finished
    while state.global_step < o.max_steps and exit_reason == "finished":
        loader = task.make_loader(cfg, rank, world, state.epoch, state.batch_in_epoch)
        data_start = time.time()
        step_start = time.time()
        data_time = 0.0
        yielded = 0
        for batch in loader:
            yielded += 1
            data_time += time.time() - data_start
            state.batch_in_epoch += 1
            state.corrupt_skipped = loader.stats.total_skipped if hasattr(loader, "stats") else 0
            lrs = apply_lr(optimizer, state.global_step, o.warmup_steps, o.max_steps, o.min_lr)
            batch = _to_device(batch, device, float_dtype)
            with autocast_context(cfg):
                out = task.losses(engine, batch, state)
            loss = out["loss"]
            if state.global_step in nan_steps and micro == 0:
                nan_steps.discard(state.global_step)
                loss = loss * float("nan")  # fault injection for tests (run.inject_nonfinite_at_steps)
            finite = bool(torch.isfinite(loss.detach()).item())
            (any_bad,) = _all_ranks_max([0.0 if finite else 1.0], device)
            if any_bad:
                # every rank skips this micro-batch together: no backward, so nothing reaches the
                # optimizer (with accumulation, the other micro-batches of the step still count)
                state.nonfinite_skipped += 1
                in_a_row += 1
                log.event(f"[train] non-finite loss at step {state.global_step}: skipped "
                          f"({in_a_row} in a row, {state.nonfinite_skipped} in total)")
                if in_a_row >= cfg.run.max_nonfinite_in_row:
                    raise NonFiniteLossError(
                        f"{in_a_row} non-finite losses in a row at step {state.global_step} (limit "
                        f"run.max_nonfinite_in_row={cfg.run.max_nonfinite_in_row}); lower optim.lr_rest / "
                        "optim.lr_vision or check the data")
                data_start = time.time()
                continue
            engine.backward(loss)
            for key, value in out.items():
                if key.startswith("loss"):
                    losses_accum[key] = losses_accum.get(key, 0.0) + float(value.detach()) / o.grad_accum_steps
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            micro += 1
            if not boundary:
                data_start = time.time()
                continue
            momentum_update(engine, cfg.distributed.zero_stage)
            in_a_row = 0
            micro = 0
            state.global_step += 1
            state.samples_seen += samples_per_step
            step_time = time.time() - step_start
            grad_norm = engine.get_global_grad_norm()
            record = {"step": state.global_step, "samples_seen": state.samples_seen, **losses_accum,
                      **{f"lr_{k}": v for k, v in lrs.items()},
                      "grad_norm": float(grad_norm) if grad_norm is not None else None,
                      "samples_per_s": samples_per_step / max(step_time, 1e-9),
                      "data_time": data_time, "step_time": step_time, "peak_memory_mb": peak_memory_mb(),
                      "epoch": state.epoch, "nonfinite_skipped": state.nonfinite_skipped,
                      "corrupt_skipped": state.corrupt_skipped}
            log.step(record)
            losses_accum = {}
            due_time = (time.time() - last_ckpt_time) / 60.0 >= cfg.run.checkpoint_every_minutes
            signal_flag, time_flag = _all_ranks_max([1.0 if stop.requested else 0.0, 1.0 if due_time else 0.0], device)
            finished = state.global_step >= o.max_steps
            if signal_flag or time_flag or finished or state.global_step % cfg.run.checkpoint_every_steps == 0:
                written = save_checkpoint(engine, ckpt_dir, state, rank, cfg.run.keep_last)
                last_ckpt_time = time.time()
                log.event(f"[train] checkpoint {written} written")
            if signal_flag:
                exit_reason = "preempted"
                if rank == 0:
                    open(os.path.join(run_dir, PREEMPTED_MARKER), "w").write(stop.signal_name or "signal")
                log.event(f"[train] stop requested ({stop.signal_name or 'signal on another rank'}): "
                          f"saved at step {state.global_step}, exiting")
                break
            if finished:
                break
            data_start = time.time()
            step_start = time.time()
            data_time = 0.0
        else:
            if yielded == 0 and state.batch_in_epoch == 0:
                from mplug_pretrain.errors import DataError
                raise DataError(f"data.train_shards: epoch {state.epoch} yielded no batch on rank {rank} "
                                f"({cfg.data.train_shards})")
            state.epoch += 1
            state.batch_in_epoch = 0
            continue
        if state.global_step >= o.max_steps:
            break
    log.close()
    if hasattr(loader_stats := getattr(loader, "stats", None), "summary") and rank == 0:
        print(f"[data] {loader_stats.summary()}", flush=True)
    if exit_reason == "finished":
        save_final_model(engine, os.path.join(run_dir, "model"), cfg.distributed.zero_stage, rank, cfg)
        if rank == 0:
            plot_losses(run_dir)
    summary = {"exit": exit_reason, "global_step": state.global_step, "samples_seen": state.samples_seen,
               "nonfinite_skipped": state.nonfinite_skipped, "run_dir": run_dir}
    return {"summary": summary, "engine": engine, "state": state}


