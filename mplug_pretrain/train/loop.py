"""The training loop every task shares (pretraining, caption XE/SCST, VQA): one batch goes
loader -> ``task.losses(module, batch, state)`` -> DeepSpeed backward/step -> our LR schedule ->
momentum update (when the model has momentum encoders) -> log -> checkpoint.

A task supplies the model, the loader for (epoch, start batch) and the loss computation; the loop
owns DeepSpeed, exact resume, non-finite skipping, signals, logging and the final model folder.

``run_training`` reads as its steps: ``_setup`` (distributed, run folder, model, engine) -> ``_resume``
-> per batch ``_micro_step`` (forward, finiteness, backward, engine step) -> at each optimizer-step
boundary ``_finish_step`` (momentum update, ``_log_step``, ``_maybe_checkpoint``) -> ``_finish``.

Host syncs: one per micro-step (the all-rank finiteness flag, needed before backward to skip a
non-finite micro-batch, which carries the stop-signal and checkpoint-due flags along; the model's forward has
none, bench/NOTES.md) and one per log step: every step's record is kept with its device values (losses
accumulated in float64, the gradient norm) and the pending records are read together at the next log step,
checkpoint or exit, so log.jsonl still holds one record per step. No autocast here: a bf16 engine
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
from mplug_pretrain.data.reading.decode_stats import (
    ABSENT_FIELD_SKIPS,
    DecodeStats,
    nothing_decoded,
    sum_over_ranks,
)
from mplug_pretrain.data.reading.epoch_plan import derive_seed
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.train import checkpoint as ckpt
from mplug_pretrain.train.block_compile import TEXT_LENGTH_MULTIPLE, pad_text, transformer_blocks
from mplug_pretrain.train.checkpoint import TrainerState
from mplug_pretrain.train.config_change import check_resume_config
from mplug_pretrain.train.distributed import init_distributed, naming_peer_failures
from mplug_pretrain.train.engine import after_optimizer_step, build_engine, engine_precision, save_final_model
from mplug_pretrain.train.flops import current_peak_flops, mfu
from mplug_pretrain.train.run_folder import RunFolderLock, claim_run_folder
from mplug_pretrain.train.run_log import RunLog, peak_memory_mb, plot_losses, reporters, truncate_log
from mplug_pretrain.train.sample_keys import record_keys, truncate_keys
from mplug_pretrain.train.schedule import apply_lr
from mplug_pretrain.train.signals import PREEMPTED_MARKER, StopRequest
from mplug_pretrain.train.world_change import (
    LayoutChange,
    end_epoch,
    mark_resplit,
    merged_trainer_state,
    plan_layout_change,
    resplit_point,
)
from mplug_pretrain.utils import process_group
from mplug_pretrain.utils.atomic_files import write_json_atomic, write_text_atomic

BEST_METRICS_FILE = "val_metrics.json"


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
        run config's data.train_shards. A loader with ``set_epoch(epoch, start_batch)`` (ShardLoader) is made
        once and moved to each next epoch, so its persistent workers stay up.
    losses(module, batch, state) -> {"loss": scalar to optimise, "loss_*": scalars to log}
    flops_per_sample(cfg, batch) -> model FLOPs (forward + backward) of one sample of this batch, for MFU
        (None: the task has no FLOP count and MFU is not logged)
    validate(module, cfg) -> {"val_*": number}: held-out metrics, called on every rank in eval mode without
        gradient, every run.eval_every_steps optimizer steps and after the last (None: the task does not validate
        this run); every rank returns the same metrics
    best_metric: the ``validate`` key whose best value keeps <run>/best/ when run.best_metric is unset
    """
    name: str
    build_model: Callable[[Config], torch.nn.Module]
    make_loader: Callable[[Config, LoaderSpec], Iterable[dict]]
    losses: Callable[[torch.nn.Module, dict, TrainerState], dict]
    flops_per_sample: Callable[[Config, dict], float] | None = None
    validate: Callable[[torch.nn.Module, Config], dict] | None = None
    best_metric: str = ""


def training_loader_spec(cfg: Config, rank: int, world_size: int, state: TrainerState) -> LoaderSpec:
    """data.* and run.seed, shuffled, from the run's position (epoch, batches of it already consumed)."""
    d = cfg.data
    return LoaderSpec(d.train_shards, d.batch_size, d.num_workers, mode=d.mode, seed=cfg.run.seed, shuffle=True,
                      shuffle_buffer=d.shuffle_buffer, samples_per_epoch=d.samples_per_epoch, weights=d.train_weights,
                      epoch=state.epoch, start_batch=state.batch_in_epoch, rank=rank, world_size=world_size,
                      resplit_from=resplit_point(state),  # the rest of an epoch begun on another layout
                      pin_memory=torch.cuda.is_available(),  # pinned batches: the non_blocking copies overlap
                      max_image_pixels=d.max_image_pixels)


# Flags the tasks read on the host (which rows are padding): they stay there, so reading them is no device sync.
HOST_KEYS = ("is_pad",)


def _to_device(batch: dict, device, float_dtype=None, image_normalize=None) -> dict:
    """Tensors to ``device``; a uint8 ``image`` [B, 3, H, W] (the training loaders send uint8) is normalised there
    by the loader's ``image_normalize`` (data/device_normalize.py), once, after the 4x smaller copy."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and key not in HOST_KEYS:
            value = value.to(device, non_blocking=True)
            if key == "image" and value.dtype == torch.uint8:
                if image_normalize is None:
                    raise ValueError("batch['image'] is uint8 but the loader names no image_normalize")
                value = image_normalize(value)
            if float_dtype is not None and value.is_floating_point():
                value = value.to(float_dtype)
        out[key] = value
    return out


def _all_rank_flags(loss: torch.Tensor, stop_requested: bool, checkpoint_due: bool) -> tuple[bool, bool, bool]:
    """(loss non-finite, stop requested, checkpoint due by time), each true when it is on any rank: the host's two
    flags ride along with the loss's (one all-reduce, one host sync per micro-step, the only one outside log
    steps)."""
    host = torch.tensor([float(stop_requested), float(checkpoint_due)], dtype=torch.float64)
    bad = (~torch.isfinite(loss.detach())).to(torch.float64).reshape(1)
    flags = torch.cat([bad, host.to(bad.device, non_blocking=True)])
    if process_group.world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    nonfinite, stop, due = flags.tolist()
    return bool(nonfinite), bool(stop), bool(due)


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
    image_normalize: Callable | None = None  # the current loader's, for its uint8 images
    resume_tag: str | None = None  # the checkpoint this run continues
    resume_warnings: list = field(default_factory=list)  # damaged newer tags skipped
    layout_change: LayoutChange | None = None  # the checkpoint's layout against this run's (train/world_change.py)
    configured_batch: tuple = ()  # (data.batch_size, optim.grad_accum_steps) as configured, before any re-derivation
    lock: RunFolderLock | None = None  # rank 0's hold on the run folder
    best: float | None = None  # run.best_metric's best value so far (its model is <run>/best/)
    stop_flags: tuple[bool, bool] = (False, False)  # (stop requested, checkpoint due by time) on any rank
    # log records whose device values (losses, gradient norm) are read together at the next log step:
    # (record, keys, values [len(keys)] float64 on the device)
    pending_records: list = field(default_factory=list)

    @property
    def samples_per_step(self) -> int:
        return self.cfg.data.batch_size * self.cfg.optim.grad_accum_steps * self.world

    @property
    def batch_layout(self) -> dict:
        """What the checkpoint marker keeps of the batch: the global batch, and the per-rank batch and accumulation
        as configured (a resume on another rank count re-derives them from these: train/world_change.py)."""
        return {"global_batch": self.samples_per_step, "configured_batch": list(self.configured_batch)}


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
    ckpt.refuse_symlinked(ckpt_dir)
    tag, warnings = ckpt.resolve_resume(resume, ckpt_dir)
    newer, change = [], None
    configured_batch = (cfg.data.batch_size, cfg.optim.grad_accum_steps)
    if tag is not None:
        change = plan_layout_change(cfg, ckpt_dir, tag, world)  # keeps the global batch on another rank count
        check_resume_config(cfg, ckpt_dir, tag, batch_rederived=change is not None and change.batch_rederived)
        ckpt.refuse_unsafe_tag(os.path.join(ckpt_dir, tag))  # a copied run folder may hold a pickle that runs code
        newer = ckpt.check_newer_tags(ckpt_dir, tag, cfg.run.discard_newer)
    if rank == 0:
        for warning in warnings:
            print(warning, flush=True)
        if newer:
            print(f"[train] run.discard_newer: deleted {', '.join(ckpt.discard_newer(ckpt_dir, tag))} (newer than "
                  f"{tag})", flush=True)
        os.makedirs(ckpt_dir, exist_ok=True)
        marker = os.path.join(run_dir, PREEMPTED_MARKER)
        if os.path.exists(marker):
            os.remove(marker)
    _record_world(run_dir, info)
    seed_everything(cfg.run.seed + rank)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)

    model = task.build_model(cfg)
    resharding = change is not None and change.reshard
    partitioned = tag is not None and not resharding and ckpt.partitioned_layout(os.path.join(ckpt_dir, tag))
    engine, optimizer, ds_config = build_engine(model, cfg, world, partitioned)
    stage = ds_config["zero_optimization"]["stage"]
    if stage != cfg.distributed.zero_stage and rank == 0:
        print(f"[train] distributed.zero_stage={cfg.distributed.zero_stage} on one rank runs as ZeRO-0: nothing to "
              "partition, so no flat gradient buffer and no copy of every gradient "
              "(distributed.single_rank_zero0=false keeps the stage)", flush=True)
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
                resume_tag=tag, resume_warnings=warnings, lock=lock, layout_change=change,
                configured_batch=configured_batch)


def _resume(run: _Run) -> None:
    """Load the chosen checkpoint (if any), then write config.yaml (only now: a refused or failed load leaves
    the folder as it was), drop log records after the checkpoint, open the log."""
    cfg, tag = run.cfg, run.resume_tag
    if tag is not None:
        settings = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
        change = run.layout_change
        if change is not None and change.reshard:
            run.state = _load_resharded(run, change)
        else:
            run.state = ckpt.load_checkpoint(run.engine, run.ckpt_dir, tag, run.rank)
        for group, own in zip(run.optimizer.param_groups, settings):
            group.update(own)  # this config's peak lrs, decay, betas: a change run.allow_config_change accepted applies
    layout_notes = _layout_notes(run) if tag is not None else []
    if tag is not None and cfg.run.record_sample_keys:
        truncate_keys(run.run_dir, run.state.global_step, [run.rank])
    if run.rank == 0:
        save_config(cfg, os.path.join(run.run_dir, "config.yaml"))
        if tag is not None:
            truncate_log(run.run_dir, run.state.global_step)
            if cfg.run.record_sample_keys and run.layout_change is not None:  # the old layout's other ranks
                truncate_keys(run.run_dir, run.state.global_step, list(range(run.world, run.layout_change.saved_world)))
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
        for note in layout_notes:
            run.log.event(note)
    run.nan_steps = set(cfg.run.inject_nonfinite_at_steps)
    run.last_ckpt_time = time.time()
    if tag is not None:
        run.best = _read_best(run.run_dir, _best_metric(run))


def _load_resharded(run: _Run, change: LayoutChange) -> TrainerState:
    """A checkpoint of another rank count or ZeRO stage: its consolidated weights and optimizer state into this
    engine (train/reshard.py), every old rank's trainer state merged, this rank's RNG reseeded."""
    from mplug_pretrain.train.reshard import load_resharded
    load_resharded(run.engine, run.ckpt_dir, run.resume_tag, run.rank, change.stage, change.saved_world)
    states = ckpt.read_trainer_states(run.ckpt_dir, run.resume_tag, change.saved_world)
    state = merged_trainer_state(states, run.rank)
    seed_everything(derive_seed(run.cfg.run.seed, run.rank, state.global_step) % 2**62)
    return state


def _layout_notes(run: _Run) -> list[str]:
    """What the resume changed of the layout (rank 0 prints them once the log is open)."""
    change = run.layout_change
    if change is None or not change.changed:
        return []
    notes = list(change.notes)
    if change.reshard:
        notes.append(f"[train] {run.resume_tag}: written by {change.saved_world} rank(s) at ZeRO-{change.saved_stage}, "
                     f"resumed on {change.world} at ZeRO-{change.stage}: weights, optimizer moments, momentum "
                     "encoders and queues re-split; each rank's RNG reseeded from (run.seed, rank, step)")
    resplit = mark_resplit(run.state, change, os.path.join(run.ckpt_dir, run.resume_tag))
    if resplit:
        notes.append(resplit)
    return notes


def _micro_step(run: _Run, batch: dict) -> tuple[dict, bool] | None:
    """Forward, finiteness check, backward and engine step of one micro-batch.
    -> None when the micro-batch was skipped (non-finite loss on some rank), else (lrs, boundary)."""
    cfg, state, engine = run.cfg, run.state, run.engine
    lrs = apply_lr(run.optimizer, state.global_step, cfg.optim.warmup_steps, cfg.optim.max_steps, cfg.optim.min_lr)
    if run.task.flops_per_sample is not None and run.peak_flops is not None:
        run.flops_per_sample = run.task.flops_per_sample(cfg, batch)
    batch = _to_device(batch, run.device, run.float_dtype, run.image_normalize)
    if cfg.run.compile:
        batch = pad_text(batch)  # a few static text lengths for the compiled blocks
    out = run.task.losses(engine, batch, state)  # no autocast here: a bf16 engine enters its own
    loss = out["loss"]
    if state.global_step in run.nan_steps and run.micro == 0:
        run.nan_steps.discard(state.global_step)
        loss = loss * float("nan")  # fault injection for tests (run.inject_nonfinite_at_steps)
    module = engine.module
    due = (time.time() - run.last_ckpt_time) / 60.0 >= cfg.run.checkpoint_every_minutes
    nonfinite, *stop_flags = _all_rank_flags(loss, run.stop is not None and run.stop.requested, due)
    run.stop_flags = tuple(stop_flags)
    if nonfinite:
        # every rank skips this micro-batch together: no backward, so nothing reaches the
        # optimizer (with accumulation, the other micro-batches of the step still count), and its momentum
        # features never reach the queues
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
    """This step's log record; its device values are read with the others pending at log steps (one sync)."""
    state = run.state
    data = None  # reader counts of all ranks, summed at log steps only (one all-reduce)
    log_step = state.global_step % run.cfg.run.log_every == 0 or state.global_step >= run.cfg.optim.max_steps
    if log_step:
        data = DecodeStats(sum_over_ranks(state.data_counts))
        state.corrupt_skipped = data.total_skipped
    device_values = {k: torch.as_tensor(v).reshape(1) for k, v in run.losses_accum.items()}
    grad_norm = run.engine.get_global_grad_norm()
    if isinstance(grad_norm, torch.Tensor):
        device_values["grad_norm"] = grad_norm.detach().to(torch.float64).reshape(1).clone()
        grad_norm = None
    samples_per_s = run.samples_per_step / max(step_time, 1e-9)
    record = {"step": state.global_step, "samples_seen": state.samples_seen, **dict.fromkeys(run.losses_accum),
              **{f"lr_{k}": v for k, v in lrs.items()},
              "grad_norm": float(grad_norm) if grad_norm is not None else None,  # filled at the read when a tensor
              "samples_per_s": samples_per_s,
              "data_time": data_time, "step_time": step_time, "data_wait_share": data_wait_share(data_time, step_time),
              "peak_memory_mb": peak_memory_mb(),
              "epoch": state.epoch, "nonfinite_skipped": state.nonfinite_skipped,
              "corrupt_skipped": state.corrupt_skipped}
    run.losses_accum = {}
    if data is not None:
        record["data_skipped"] = data.skipped  # by kind
    if run.flops_per_sample is not None:
        record["flops_per_sample"] = run.flops_per_sample
        record["mfu"] = mfu(run.flops_per_sample, samples_per_s / run.world, run.peak_flops)
    keys = list(device_values)
    values = torch.cat([device_values[k].to(torch.float64) for k in keys]) if keys else None
    run.pending_records.append((record, keys, values))
    if log_step:
        _write_pending_records(run)


def _write_pending_records(run: _Run) -> None:
    """Read the device values of every pending record at once (one host sync) and write the records."""
    pending, run.pending_records = run.pending_records, []
    tensors = [values for _, _, values in pending if values is not None]
    read = iter(torch.cat([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
    for record, keys, _ in pending:
        record.update({key: next(read) for key in keys})
        run.log.step(record)


def data_wait_share(data_time: float, step_time: float) -> float:
    """The part of an optimizer step spent waiting for the loader's next batch (0..1): near 1, the loader is the
    limit (more data.num_workers, or faster storage); near 0, the model is."""
    return min(1.0, max(0.0, data_time / step_time)) if step_time > 0 else 0.0


def _maybe_checkpoint(run: _Run) -> bool:
    """Checkpoint when due (steps, minutes, a stop signal on any rank, the last step).
    -> True when a stop was requested (the run is then saved and must exit)."""
    cfg, state = run.cfg, run.state
    signal_flag, time_flag = run.stop_flags  # read with the last micro-step's finiteness flag: no sync of its own
    finished = state.global_step >= cfg.optim.max_steps
    if signal_flag or time_flag or finished or state.global_step % cfg.run.checkpoint_every_steps == 0:
        _write_pending_records(run)  # the log holds every step up to the checkpoint (a resume truncates after it)
        written = ckpt.save_checkpoint(run.engine, run.ckpt_dir, state, run.rank, cfg.run.keep_last, run.world,
                                       run_config=config_text(cfg), task=run.task.name, layout=run.batch_layout)
        run.last_ckpt_time = time.time()
        run.log.event(f"[train] checkpoint {written} written")
    if signal_flag:
        run.exit_reason = "preempted"
        if run.rank == 0:
            write_text_atomic(os.path.join(run.run_dir, PREEMPTED_MARKER), run.stop.signal_name or "signal")
        run.log.event(f"[train] stop requested ({run.stop.signal_name or 'signal on another rank'}): "
                      f"saved at step {state.global_step}, exiting")
    return bool(signal_flag)


def _maybe_validate(run: _Run) -> None:
    """Held-out validation when due (``TrainTask.validate``): logged with the time it took; the model folder
    ``<run>/best/`` (and its ``val_metrics.json``) replaced when run.best_metric improves."""
    cfg, state = run.cfg, run.state
    every = cfg.run.eval_every_steps
    last = state.global_step >= cfg.optim.max_steps
    if run.task.validate is None or not (last or (every and state.global_step % every == 0)):
        return
    _write_pending_records(run)  # the steps before it first: log.jsonl stays in step order (a sync; rare)
    module = run.engine.module
    modes = {m: m.training for m in module.modules()}  # frozen parts stay in eval mode afterwards
    started = time.time()
    module.eval()
    try:
        with torch.no_grad(), _engine_autocast(run.engine):
            metrics = run.task.validate(module, cfg)
    finally:
        for m, training in modes.items():
            m.training = training
    record = {"step": state.global_step, "samples_seen": state.samples_seen, **metrics,
              "val_time_s": time.time() - started}
    run.log.validation(record)
    best_metric = _best_metric(run)
    value = metrics.get(best_metric)
    if value is None:
        return
    lower_is_better = "loss" in best_metric
    if run.best is None or (value < run.best if lower_is_better else value > run.best):
        run.best = value
        best_dir = os.path.join(run.run_dir, "best")
        save_final_model(run.engine, best_dir, cfg.distributed.zero_stage, run.rank, cfg)
        if run.rank == 0:
            write_json_atomic(os.path.join(best_dir, BEST_METRICS_FILE), record)
        run.log.event(f"[val] {best_metric} {value:.4g}: best so far, model in {best_dir}")


def _engine_autocast(engine):
    """The engine's own bf16 autocast for a forward that bypasses ``engine(...)`` (validation), else nothing."""
    import contextlib
    if engine_precision(engine) == "bf16":
        return torch.autocast(device_type=torch.device(engine.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _best_metric(run: _Run) -> str:
    """run.best_metric, else the task's own (pretraining: val_itc_r1)."""
    return run.cfg.run.best_metric or run.task.best_metric


def _read_best(run_dir: str, metric: str) -> float | None:
    """The best value recorded in <run>/best/ by an earlier part of this run (resume), if any."""
    import json
    try:
        with open(os.path.join(run_dir, "best", BEST_METRICS_FILE)) as f:
            value = json.load(f).get(metric)
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _finish_step(run: _Run, lrs: dict, data_time: float, step_time: float) -> bool:
    """After an optimizer step: momentum update, counters, log, checkpoint. -> True to stop training."""
    after_optimizer_step(run.engine, run.cfg.distributed.zero_stage)  # momentum EMA, temperature clamp
    run.in_a_row = 0
    run.micro = 0
    run.state.global_step += 1
    run.state.samples_seen += run.samples_per_step
    _log_step(run, lrs, data_time, step_time)
    _maybe_validate(run)
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
    counted = Counter(loader.stats.counts) if hasattr(loader, "stats") else Counter()  # earlier passes of a reused loader
    run.image_normalize = getattr(loader, "image_normalize", None)
    for batch in loader:
        yielded += 1
        data_time += time.time() - data_start
        state.batch_in_epoch += 1
        if run.cfg.run.record_sample_keys and "__key__" in batch:
            record_keys(run.run_dir, run.rank, state.global_step + 1, state.epoch, batch["__key__"],
                        batch.get("is_pad"))
        if hasattr(loader, "stats"):
            state.data_counts = dict(before + (loader.stats.counts - counted))
            if yielded == max(run.cfg.data.num_workers, 1):  # each worker's first batch of this pass is in
                _refuse_undecodable(run, loader.stats.counts - counted,
                                    f"the first {yielded} batch(es) of epoch {state.epoch}", one_reason=True)
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
    end_epoch(state)
    return True


def _refuse_undecodable(run: _Run, counts: dict[str, int], where: str, one_reason: bool = False) -> None:
    """A run that decodes no sample trains on padding only (every loss 0) and must not exit 0. ``one_reason``:
    only when every skip had the same absent-field reason (early batches: a first batch of corrupt samples is no
    verdict, the run trains through it)."""
    verdict = nothing_decoded(counts)
    reasons = list(DecodeStats(counts).skipped)
    if verdict is not None and (not one_reason or (len(reasons) == 1 and reasons[0] in ABSENT_FIELD_SKIPS)):
        from mplug_pretrain.errors import DataError
        raise DataError(f"{run.cfg.data.train_shards}: {where} decoded no sample, {verdict}: shards of "
                        f"another kind than {run.task.name} reads?")


def _finish(run: _Run, loader) -> dict:
    """Close the log, report corrupt samples, write the final model folder and plots (finished runs)."""
    _write_pending_records(run)
    run.log.close()
    data_counts = sum_over_ranks(run.state.data_counts)  # collective: every rank finishes here
    if run.exit_reason == "finished":
        _refuse_undecodable(run, data_counts, "the whole run")
    if run.rank == 0 and data_counts:
        print(DecodeStats(data_counts).log_line(), flush=True)
    if run.exit_reason == "finished":
        save_final_model(run.engine, os.path.join(run.run_dir, "model"), run.cfg.distributed.zero_stage, run.rank,
                         run.cfg)
        if run.rank == 0 and run.cfg.run.plot_losses:
            plot_losses(run.run_dir)
    if run.lock is not None:
        run.lock.release()  # (a run that fails releases it when it is collected, or when the process ends)
    s = run.state
    summary = {"exit": run.exit_reason, "global_step": s.global_step, "samples_seen": s.samples_seen,
               "nonfinite_skipped": s.nonfinite_skipped, "data": data_counts, "run_dir": run.run_dir}
    return {"summary": summary, "engine": run.engine, "state": s}


def run_training(cfg: Config, task: TrainTask, resume: str | None = None) -> dict:
    """Train until ``optim.max_steps`` optimizer steps (or a stop signal). Returns a summary."""
    with naming_peer_failures(cfg.distributed.timeout_minutes):  # a frozen or failed rank: named, not a gloo trace
        run = _setup(cfg, task, resume)
        _resume(run)
        loader = None  # stays None when a resumed run had already finished
        try:
            while run.state.global_step < cfg.optim.max_steps and run.exit_reason == "finished":
                if loader is not None and hasattr(loader, "set_epoch"):
                    loader.set_epoch(run.state.epoch, run.state.batch_in_epoch)  # next epoch, same (persistent) workers
                else:
                    loader = task.make_loader(cfg, training_loader_spec(cfg, run.rank, run.world, run.state))
                if not _train_epoch(run, loader):
                    break
        except Exception:
            if run.pending_records:  # a run that stops on an error keeps the steps it trained in log.jsonl
                _write_pending_records(run)
            raise
        return _finish(run, loader)
