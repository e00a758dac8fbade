"""The training loop every task shares (pretraining, caption XE/SCST, VQA): one batch goes
loader -> ``task.losses(module, batch, state)`` -> DeepSpeed backward/step -> our LR schedule ->
momentum update (when the model has momentum encoders) -> log -> checkpoint.

A task supplies the model, the loader for (epoch, start batch) and the loss computation; the loop
owns DeepSpeed, exact resume, non-finite skipping, signals, logging and the final model folder.

``run_training`` reads as its steps: ``_setup`` (distributed, run folder, model, engine) -> ``_resume``
-> per batch ``_micro_step`` (forward, finiteness, backward, engine step) -> at each optimizer-step
boundary ``_finish_step`` (momentum update, ``_log_step``, ``_maybe_checkpoint``) -> ``_finish``.

Host syncs: one per micro-step (the all-rank finiteness flag, needed before backward to skip a
non-finite micro-batch; the model's forward has none, bench/README.md) and, per optimizer step, the log
record's (the accumulated losses, read together) and the checkpoint-due flag; the losses are accumulated on
the device in float64, exactly as the former per-micro-step ``float()``. No autocast here: a bf16 engine
runs its forward under its own (train/engine.py)."""
from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from mplug_pretrain.config import Config, config_text, save_config
from mplug_pretrain.data.reading.decode_stats import DecodeStats, sum_over_ranks
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.train import checkpoint as ckpt
from mplug_pretrain.train.block_compile import TEXT_LENGTH_MULTIPLE, pad_text, transformer_blocks
from mplug_pretrain.train.checkpoint import TrainerState
from mplug_pretrain.train.config_change import check_resume_config
from mplug_pretrain.train.distributed import init_distributed
from mplug_pretrain.train.engine import after_optimizer_step, build_engine, engine_precision, save_final_model
from mplug_pretrain.train.flops import current_peak_flops, mfu
from mplug_pretrain.train.run_folder import RunFolderLock, claim_run_folder
from mplug_pretrain.train.run_log import RunLog, peak_memory_mb, plot_losses, reporters, truncate_log
from mplug_pretrain.train.schedule import apply_lr
from mplug_pretrain.train.signals import PREEMPTED_MARKER, StopRequest
from mplug_pretrain.utils import process_group
from mplug_pretrain.utils.atomic_files import write_text_atomic


class NonFiniteLossError(RuntimeError):
    pass


def _record_world(run_dir: str, info) -> None:
    """<run>/world.json: which host each rank runs on (rank 0 writes it; appended per (re)start)."""
    import json
    import socket
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # Slurm's node name, else the host
    hosts = [None] * info.world_size
    if process_group.world_size() > 1:
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
    make_loader(cfg, spec) -> iterable of batch dicts (deterministic for a given epoch); ``spec``
        (``training_loader_spec``): data.train_shards read as data.* says from this rank's position (its
        ``start_batch`` skips the batches already consumed); fine-tuning tasks make their own shards the
        run config's data.train_shards.
    losses(module, batch, state) -> {"loss": scalar to optimise, "loss_*": scalars to log}
    flops_per_sample(cfg, batch) -> model FLOPs (forward + backward) of one sample of this batch, for MFU
        (None: the task has no FLOP count and MFU is not logged)
    """
    name: str
    build_model: Callable[[Config], torch.nn.Module]
    make_loader: Callable[[Config, LoaderSpec], Iterable[dict]]
    losses: Callable[[torch.nn.Module, dict, TrainerState], dict]
    flops_per_sample: Callable[[Config, dict], float] | None = None


def training_loader_spec(cfg: Config, rank: int, world_size: int, state: TrainerState) -> LoaderSpec:
    """data.* and run.seed, shuffled, from the run's position (epoch, batches of it already consumed)."""
    d = cfg.data
    return LoaderSpec(d.train_shards, d.batch_size, d.num_workers, mode=d.mode, seed=cfg.run.seed, shuffle=True,
                      shuffle_buffer=d.shuffle_buffer, samples_per_epoch=d.samples_per_epoch, weights=d.train_weights,
                      epoch=state.epoch, start_batch=state.batch_in_epoch, rank=rank, world_size=world_size,
                      pin_memory=torch.cuda.is_available())  # pinned batches: the non_blocking copies overlap


# Flags the tasks read on the host (which rows are padding): they stay there, so reading them is no device sync.
HOST_KEYS = ("is_pad",)


def _to_device(batch: dict, device, float_dtype=None) -> dict:
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and key not in HOST_KEYS:
            value = value.to(device, non_blocking=True)
            if float_dtype is not None and value.is_floating_point():
                value = value.to(float_dtype)
        out[key] = value
    return out


def _all_ranks_max(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if process_group.world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _any_rank_nonfinite(loss: torch.Tensor) -> bool:
    """True when the loss is NaN/inf on any rank: one all-reduce and one host sync."""
    bad = (~torch.isfinite(loss.detach())).to(torch.float64).reshape(1)
    if process_group.world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item())


@dataclass
class _Run:
    """Everything one ``run_training`` call holds while it trains."""
    cfg: Config
    task: TrainTask
    rank: int
    world: int
    run_dir: str
    ckpt_dir: str
    engine: object
    optimizer: torch.optim.Optimizer
    device: torch.device
    float_dtype: torch.dtype | None
    peak_flops: float | None
    state: TrainerState = field(default_factory=TrainerState)
    log: RunLog | None = None
    stop: StopRequest | None = None
    nan_steps: set = field(default_factory=set)
    last_ckpt_time: float = 0.0
    in_a_row: int = 0
    exit_reason: str = "finished"
    losses_accum: dict = field(default_factory=dict)  # key -> float64 device tensor
    micro: int = 0
    flops_per_sample: float | None = None  # of the last micro-batch
    resume_tag: str | None = None  # the checkpoint this run continues
    resume_warnings: list = field(default_factory=list)  # damaged newer tags skipped
    lock: RunFolderLock | None = None  # rank 0's hold on the run folder

    @property
    def samples_per_step(self) -> int:
        return self.cfg.data.batch_size * self.cfg.optim.grad_accum_steps * self.world


def bare_run(cfg: Config, task: TrainTask, engine, optimizer, rank: int = 0, world: int = 1) -> _Run:
    """A ``_Run`` without run folder or log file, for benches and tests that drive ``_micro_step`` themselves."""
    run = _Run(cfg=cfg, task=task, rank=rank, world=world, run_dir="", ckpt_dir="", engine=engine,
               optimizer=optimizer, device=engine.device, float_dtype=None, peak_flops=None)
    run.log = RunLog(os.devnull, cfg.optim.max_steps, enabled=False, tensorboard=False)
    return run


def _setup(cfg: Config, task: TrainTask, resume: str | None) -> _Run:
    """Distributed init; the run folder claimed (refused when it holds another run, locked); the checkpoint to
    resume chosen and the config compared with its own, all before the model is built; seeds, engine."""
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_minutes)
    lock = claim_run_folder(cfg.run_dir, resume, cfg.run.overwrite) if info.rank == 0 else None
    try:
        return _prepare(cfg, task, resume, info, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _prepare(cfg: Config, task: TrainTask, resume: str | None, info, lock: RunFolderLock | None) -> _Run:
    """The rest of ``_setup``, once the run folder is this run's."""
    rank, world = info.rank, info.world_size
    run_dir = cfg.run_dir
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    tag, warnings = ckpt.resolve_resume(resume, ckpt_dir)
    if tag is not None:
        check_resume_config(cfg, ckpt_dir, tag, world)
        ckpt.refuse_unsafe_tag(os.path.join(ckpt_dir, tag))  # a copied run folder may hold a pickle that runs code
    if rank == 0:
        for warning in warnings:
            print(warning, flush=True)
        os.makedirs(ckpt_dir, exist_ok=True)
        marker = os.path.join(run_dir, PREEMPTED_MARKER)
        if os.path.exists(marker):
            os.remove(marker)
    _record_world(run_dir, info)
    seed_everything(cfg.run.seed + rank)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)

    model = task.build_model(cfg)
    engine, optimizer, _ = build_engine(model, cfg, world)
    if cfg.run.compile and rank == 0:
        print(f"[train] run.compile: {len(transformer_blocks(engine.module))} blocks compiled one by one "
              f"({cfg.run.compile_backend}; text padded to a multiple of {TEXT_LENGTH_MULTIPLE})", flush=True)
    float_dtype = None  # batches stay fp32: a bf16 engine's own autocast casts them at its bf16 matmuls
    on_gpu = torch.device(engine.device).type == "cuda"
    # the GPU table holds bf16 peaks: an fp32 run on a GPU reports no MFU rather than a wrong one
    bf16 = engine_precision(engine) == "bf16"
    peak = current_peak_flops(engine.device, cfg.run.cpu_peak_flops) if (bf16 or not on_gpu) else None
    return _Run(cfg=cfg, task=task, rank=rank, world=world, run_dir=run_dir, ckpt_dir=ckpt_dir, engine=engine,
                optimizer=optimizer, device=engine.device, float_dtype=float_dtype, peak_flops=peak,
                resume_tag=tag, resume_warnings=warnings, lock=lock)


def _resume(run: _Run) -> None:
    """Load the chosen checkpoint (if any), then write config.yaml (only now: a refused or failed load leaves
    the folder as it was), drop log records after the checkpoint, open the log."""
    cfg, tag = run.cfg, run.resume_tag
    if tag is not None:
        settings = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
        run.state = ckpt.load_checkpoint(run.engine, run.ckpt_dir, tag, run.rank)
        for group, own in zip(run.optimizer.param_groups, settings):
            group.update(own)  # this config's peak lrs, decay, betas: a change run.allow_config_change accepted applies
    if run.rank == 0:
        save_config(cfg, os.path.join(run.run_dir, "config.yaml"))
        if tag is not None:
            truncate_log(run.run_dir, run.state.global_step)
            if run.resume_warnings:
                ckpt.name_latest(run.ckpt_dir, tag)  # a damaged newer tag was skipped: `latest` names a complete one
    run.stop = StopRequest().install()
    run.log = RunLog(run.run_dir, cfg.optim.max_steps, enabled=run.rank == 0, **reporters(cfg),
                     print_every=cfg.run.log_every, initial_step=run.state.global_step)
    if tag is not None:
        s = run.state
        fallback = f" (the newer tag(s) were damaged: {len(run.resume_warnings)} skipped)" if run.resume_warnings else ""
        run.log.event(f"[train] resumed from {tag}: step {s.global_step}, samples {s.samples_seen}, "
                      f"epoch {s.epoch} batch {s.batch_in_epoch}{fallback}")
    run.nan_steps = set(cfg.run.inject_nonfinite_at_steps)
    run.last_ckpt_time = time.time()


def _micro_step(run: _Run, batch: dict) -> tuple[dict, bool] | None:
    """Forward, finiteness check, backward and engine step of one micro-batch.
    -> None when the micro-batch was skipped (non-finite loss on some rank), else (lrs, boundary)."""
    cfg, state, engine = run.cfg, run.state, run.engine
    lrs = apply_lr(run.optimizer, state.global_step, cfg.optim.warmup_steps, cfg.optim.max_steps, cfg.optim.min_lr)
    if run.task.flops_per_sample is not None and run.peak_flops is not None:
        run.flops_per_sample = run.task.flops_per_sample(cfg, batch)
    batch = _to_device(batch, run.device, run.float_dtype)
    if cfg.run.compile:
        batch = pad_text(batch)  # a few static text lengths for the compiled blocks
    out = run.task.losses(engine, batch, state)  # no autocast here: a bf16 engine enters its own
    loss = out["loss"]
    if state.global_step in run.nan_steps and run.micro == 0:
        run.nan_steps.discard(state.global_step)
        loss = loss * float("nan")  # fault injection for tests (run.inject_nonfinite_at_steps)
    module = engine.module
    if _any_rank_nonfinite(loss):
        # every rank skips this micro-batch together: no backward, so nothing reaches the
        # optimizer (with accumulation, the other micro-batches of the step still count), and its momentum
        # features never reach the queues
        if hasattr(module, "discard_enqueue"):
            module.discard_enqueue()
        state.nonfinite_skipped += 1
        run.in_a_row += 1
        run.log.event(f"[train] non-finite loss at step {state.global_step}: skipped "
                      f"({run.in_a_row} in a row, {state.nonfinite_skipped} in total)")
        if run.in_a_row >= cfg.run.max_nonfinite_in_row:
            raise NonFiniteLossError(
                f"{run.in_a_row} non-finite losses in a row at step {state.global_step} (limit "
                f"run.max_nonfinite_in_row={cfg.run.max_nonfinite_in_row}); lower optim.lr_rest / "
                "optim.lr_vision or check the data")
        return None
    if hasattr(module, "commit_enqueue"):
        module.commit_enqueue()  # the loss is finite on every rank: this batch's momentum features enter the queues
    engine.backward(loss)
    for key, value in out.items():
        if key.startswith("loss"):  # stays on the device: read once per optimizer step
            value = torch.as_tensor(value).detach().to(torch.float64) / cfg.optim.grad_accum_steps
            run.losses_accum[key] = run.losses_accum.get(key, 0.0) + value
    boundary = engine.is_gradient_accumulation_boundary()
    engine.step()
    run.micro += 1
    return lrs, boundary


def _log_step(run: _Run, lrs: dict, data_time: float, step_time: float) -> None:
    state = run.state
    data = None  # reader counts of all ranks, summed at log steps only (one all-reduce)
    if state.global_step % run.cfg.run.log_every == 0 or state.global_step >= run.cfg.optim.max_steps:
        data = DecodeStats(sum_over_ranks(state.data_counts))
        state.corrupt_skipped = data.total_skipped
    keys = list(run.losses_accum)
    values = torch.stack([torch.as_tensor(run.losses_accum[k]) for k in keys]).tolist() if keys else []
    run.losses_accum = {}
    grad_norm = run.engine.get_global_grad_norm()
    samples_per_s = run.samples_per_step / max(step_time, 1e-9)
    record = {"step": state.global_step, "samples_seen": state.samples_seen, **dict(zip(keys, values)),
              **{f"lr_{k}": v for k, v in lrs.items()},
              "grad_norm": float(grad_norm) if grad_norm is not None else None,
              "samples_per_s": samples_per_s,
              "data_time": data_time, "step_time": step_time, "peak_memory_mb": peak_memory_mb(),
              "epoch": state.epoch, "nonfinite_skipped": state.nonfinite_skipped,
              "corrupt_skipped": state.corrupt_skipped}
    if data is not None:
        record["data_skipped"] = data.skipped  # by kind
    if run.flops_per_sample is not None:
        record["flops_per_sample"] = run.flops_per_sample
        record["mfu"] = mfu(run.flops_per_sample, samples_per_s / run.world, run.peak_flops)
    run.log.step(record)


def _maybe_checkpoint(run: _Run) -> bool:
    """Checkpoint when due (steps, minutes, a stop signal on any rank, the last step).
    -> True when a stop was requested (the run is then saved and must exit)."""
    cfg, state = run.cfg, run.state
    due_time = (time.time() - run.last_ckpt_time) / 60.0 >= cfg.run.checkpoint_every_minutes
    signal_flag, time_flag = _all_ranks_max([1.0 if run.stop.requested else 0.0, 1.0 if due_time else 0.0],
                                            run.device)
    finished = state.global_step >= cfg.optim.max_steps
    if signal_flag or time_flag or finished or state.global_step % cfg.run.checkpoint_every_steps == 0:
        written = ckpt.save_checkpoint(run.engine, run.ckpt_dir, state, run.rank, cfg.run.keep_last, run.world,
                                       run_config=config_text(cfg), task=run.task.name)
        run.last_ckpt_time = time.time()
        run.log.event(f"[train] checkpoint {written} written")
    if signal_flag:
        run.exit_reason = "preempted"
        if run.rank == 0:
            write_text_atomic(os.path.join(run.run_dir, PREEMPTED_MARKER), run.stop.signal_name or "signal")
        run.log.event(f"[train] stop requested ({run.stop.signal_name or 'signal on another rank'}): "
                      f"saved at step {state.global_step}, exiting")
    return bool(signal_flag)


def _finish_step(run: _Run, lrs: dict, data_time: float, step_time: float) -> bool:
    """After an optimizer step: momentum update, counters, log, checkpoint. -> True to stop training."""
    after_optimizer_step(run.engine, run.cfg.distributed.zero_stage)  # momentum EMA, temperature clamp
    run.in_a_row = 0
    run.micro = 0
    run.state.global_step += 1
    run.state.samples_seen += run.samples_per_step
    _log_step(run, lrs, data_time, step_time)
    if _maybe_checkpoint(run):
        return True
    return run.state.global_step >= run.cfg.optim.max_steps


def _train_epoch(run: _Run, loader: Iterable[dict]) -> bool:
    """Train on ``loader`` (the rest of one epoch). -> True when the loader ran out (next epoch)."""
    state = run.state
    data_start = step_start = time.time()
    data_time = 0.0
    yielded = 0
    before = Counter(state.data_counts)  # earlier epochs and runs (resume)
    for batch in loader:
        yielded += 1
        data_time += time.time() - data_start
        state.batch_in_epoch += 1
        if hasattr(loader, "stats"):
            state.data_counts = dict(before + loader.stats.counts)
        result = _micro_step(run, batch)
        if result is not None and result[1]:  # an optimizer step ended
            if _finish_step(run, result[0], data_time, time.time() - step_start):
                return False
            step_start = time.time()
            data_time = 0.0
        data_start = time.time()
    if yielded == 0 and state.batch_in_epoch == 0:
        from mplug_pretrain.errors import DataError
        raise DataError(f"data.train_shards: epoch {state.epoch} yielded no batch on rank {run.rank} "
                        f"({run.cfg.data.train_shards})")
    state.epoch += 1
    state.batch_in_epoch = 0
    return True


def _finish(run: _Run, loader) -> dict:
    """Close the log, report corrupt samples, write the final model folder and plots (finished runs)."""
    run.log.close()
    data_counts = sum_over_ranks(run.state.data_counts)  # collective: every rank finishes here
    if run.rank == 0 and data_counts:
        print(DecodeStats(data_counts).log_line(), flush=True)
    if run.exit_reason == "finished":
        save_final_model(run.engine, os.path.join(run.run_dir, "model"), run.cfg.distributed.zero_stage, run.rank,
                         run.cfg)
        if run.rank == 0:
            plot_losses(run.run_dir)
    if run.lock is not None:
        run.lock.release()  # (a run that fails releases it when it is collected, or when the process ends)
    s = run.state
    summary = {"exit": run.exit_reason, "global_step": s.global_step, "samples_seen": s.samples_seen,
               "nonfinite_skipped": s.nonfinite_skipped, "data": data_counts, "run_dir": run.run_dir}
    return {"summary": summary, "engine": run.engine, "state": s}


def run_training(cfg: Config, task: TrainTask, resume: str | None = None) -> dict:
    """Train until ``optim.max_steps`` optimizer steps (or a stop signal). Returns a summary."""
    run = _setup(cfg, task, resume)
    _resume(run)
    loader = None  # stays None when a resumed run had already finished
    while run.state.global_step < cfg.optim.max_steps and run.exit_reason == "finished":
        loader = task.make_loader(cfg, training_loader_spec(cfg, run.rank, run.world, run.state))
        if not _train_epoch(run, loader):
            break
    return _finish(run, loader)
