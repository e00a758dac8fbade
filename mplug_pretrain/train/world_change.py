"""Resuming a checkpoint on another number of ranks, ZeRO stage or loader-worker count (a requeued Slurm job
that got another node count, a debug run moved to more nodes): what carries over, and how.

- **The global batch is kept**: G = data.batch_size x optim.grad_accum_steps x ranks of the checkpoint. On W'
  ranks the accumulation becomes G / (B x W') when that divides, else the per-rank batch G / (A x W') (the
  accumulation kept), else the resume is refused naming the rank counts that work. An optimizer step still takes
  G samples, so the step count, the LR schedule and ``samples_seen`` continue as they were: the LR stays the
  function of the samples seen that it was.
- **The rest of the epoch is re-split** over the new ranks and workers (data/reading/resplit.py: each sample
  the old layout had not consumed is read once). The point where the old layout stopped is kept in
  ``TrainerState.extra["resplit"]`` until that epoch ends, so a later resume on the new layout continues it;
  another change of layout inside that epoch is refused (finish it on the layout it was re-split to).
- **Weights, optimizer moments, momentum encoders and queues** are read consolidated from the checkpoint's
  DeepSpeed files and put into the new engine (train/reshard.py) when the rank count or the ZeRO stage differs.
- **Trainer state**: step, samples seen, epoch and position are the same on every old rank; the old ranks'
  reader counts go to the new rank 0. Per-rank RNG streams cannot carry over: each rank is reseeded from
  (run.seed, rank, step), and the log says so.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import yaml

from mplug_pretrain.config import Config, engine_zero_stage
from mplug_pretrain.data.reading.loader_spec import ResplitPoint
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.train.checkpoint import (
    TrainerState,
    partitioned_layout,
    read_marker,
    saved_run_config,
    saved_world_size,
)
from mplug_pretrain.train.config_change import BATCH_FIELDS, HARMLESS, covered

RESPLIT = "resplit"  # TrainerState.extra key: {"epoch", "world_size", "num_workers", "batch_size", "batches"}


@dataclass
class LayoutChange:
    """The checkpoint's layout against this run's (after the global batch was kept)."""
    saved_world: int
    world: int
    saved_batch: int
    batch: int
    saved_accum: int
    accum: int
    saved_workers: int
    workers: int
    saved_stage: int
    stage: int
    notes: list[str] = field(default_factory=list)
    batch_rederived: bool = False  # the per-rank batch and accumulation were set to keep the global batch


    @property
    def reshard(self) -> bool:
        """Weights and optimizer state must be re-split: another rank count or ZeRO stage."""
        return self.saved_world != self.world or self.saved_stage != self.stage

    @property
    def data_layout_changed(self) -> bool:
        return (self.saved_world, max(self.saved_workers, 1), self.saved_batch) != \
            (self.world, max(self.workers, 1), self.batch)

    @property
    def changed(self) -> bool:
        return self.reshard or self.data_layout_changed


def _saved_config(ckpt_dir: str, tag: str) -> dict | None:
    path = saved_run_config(ckpt_dir, tag)
    if path is None:
        return None
    with open(path) as f:
        return yaml.safe_load(f) or {}


def _int(section: dict, name: str, default: int) -> int:
    value = (section or {}).get(name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def keep_global_batch(global_batch: int, batch: int, accum: int, world: int) -> tuple[int, int] | None:
    """(per-rank batch, accumulation) giving ``global_batch`` on ``world`` ranks: the accumulation changed when
    that divides, else the per-rank batch; None when neither does."""
    if global_batch % (batch * world) == 0:
        return batch, global_batch // (batch * world)
    if global_batch % (accum * world) == 0:
        return global_batch // (accum * world), accum
    return None


def plan_layout_change(cfg: Config, ckpt_dir: str, tag: str, world: int) -> LayoutChange | None:
    """Compare the checkpoint's layout with this run's and set ``cfg``'s per-rank batch and accumulation so that
    the global batch stays the checkpoint's (ConfigError when no pair does on ``world`` ranks), unless the user
    changed those fields (then check_resume_config's rules apply). None when the checkpoint has no world-size
    record (nothing is changed)."""
    saved_world, saved = saved_world_size(ckpt_dir, tag), _saved_config(ckpt_dir, tag)
    if saved_world is None or saved is None:
        return None
    data, optim, dist = saved.get("data") or {}, saved.get("optim") or {}, saved.get("distributed") or {}
    saved_batch = _int(data, "batch_size", cfg.data.batch_size)
    saved_accum = _int(optim, "grad_accum_steps", cfg.optim.grad_accum_steps)
    layout = (read_marker(os.path.join(ckpt_dir, tag)) or {}).get("layout") or {}
    global_batch = layout.get("global_batch") or saved_batch * saved_accum * saved_world
    notes, rederived = [], False
    allowed = (*HARMLESS, *cfg.run.allow_config_change)
    configured = (cfg.data.batch_size, cfg.optim.grad_accum_steps)
    # the user's batch fields as the checkpoint ran them, or as configured there before a re-derivation (a
    # requeue runs the same command): keep the global batch. Anything else is a change of the run's batch,
    # which check_resume_config refuses unless run.allow_config_change names it.
    unchanged = configured in ((saved_batch, saved_accum), tuple(layout.get("configured_batch") or ()))
    if unchanged and not any(covered(name, allowed) for name in BATCH_FIELDS):
        pair = keep_global_batch(global_batch, cfg.data.batch_size, cfg.optim.grad_accum_steps, world)
        if pair is None:
            working = [w for w in range(1, global_batch + 1)
                       if keep_global_batch(global_batch, cfg.data.batch_size, cfg.optim.grad_accum_steps, w)]
            raise ConfigError(
                f"{os.path.join(ckpt_dir, tag)}: written by {saved_world} rank(s) with a global batch of "
                f"{global_batch} (data.batch_size {saved_batch} x optim.grad_accum_steps {saved_accum} x "
                f"{saved_world}); on {world} rank(s) no per-rank batch or accumulation gives {global_batch}. "
                f"Resume on one of: {', '.join(map(str, working))} rank(s)")
        rederived = pair != (saved_batch, saved_accum)
        if pair != (cfg.data.batch_size, cfg.optim.grad_accum_steps):
            notes.append(f"[train] {saved_world} -> {world} rank(s): global batch {global_batch} kept with "
                         f"data.batch_size {pair[0]} x optim.grad_accum_steps {pair[1]} (the config says "
                         f"{cfg.data.batch_size} x {cfg.optim.grad_accum_steps})")
            cfg.data.batch_size, cfg.optim.grad_accum_steps = pair
    saved_stage = _int(dist, "zero_stage", cfg.distributed.zero_stage)
    if not partitioned_layout(os.path.join(ckpt_dir, tag)):
        saved_stage = 0  # ZeRO 1-2 on one rank ran as ZeRO-0
    same = saved_world == world and _int(dist, "zero_stage", -1) == cfg.distributed.zero_stage
    # the same world and stage setting: the engine keeps the checkpoint's layout (bit-equal resume)
    stage = saved_stage if same else engine_zero_stage(cfg, world)
    return LayoutChange(saved_world=saved_world, world=world, saved_batch=saved_batch, batch=cfg.data.batch_size,
                        saved_accum=saved_accum, accum=cfg.optim.grad_accum_steps,
                        saved_workers=_int(data, "num_workers", cfg.data.num_workers),
                        workers=cfg.data.num_workers, saved_stage=saved_stage, stage=stage, notes=notes,
                        batch_rederived=rederived)


def merged_trainer_state(states: list[TrainerState], rank: int) -> TrainerState:
    """This rank's state on the new layout from every old rank's: the shared fields of rank 0; the reader
    counts of all old ranks on new rank 0 only (they are summed over ranks when reported)."""
    first = states[0]
    for other in states[1:]:
        if (other.global_step, other.epoch, other.batch_in_epoch) != (first.global_step, first.epoch,
                                                                     first.batch_in_epoch):
            raise ConfigError(f"checkpoint: ranks disagree on the position (step {first.global_step} epoch "
                              f"{first.epoch} batch {first.batch_in_epoch} vs step {other.global_step} epoch "
                              f"{other.epoch} batch {other.batch_in_epoch})")
    counts: dict = {}
    if rank == 0:
        for state in states:
            for kind, count in state.data_counts.items():
                counts[kind] = counts.get(kind, 0) + count
    return TrainerState(global_step=first.global_step, samples_seen=first.samples_seen, epoch=first.epoch,
                        batch_in_epoch=first.batch_in_epoch, nonfinite_skipped=first.nonfinite_skipped,
                        corrupt_skipped=first.corrupt_skipped, data_counts=counts, extra=dict(first.extra))


def mark_resplit(state: TrainerState, change: LayoutChange, tag_dir: str) -> str | None:
    """Record where the old layout left the current epoch (when it changes mid-epoch); -> a log line or None."""
    if not change.data_layout_changed or state.batch_in_epoch == 0:
        return None
    earlier = state.extra.get(RESPLIT)
    if earlier and earlier.get("epoch") == state.epoch:
        raise ConfigError(
            f"{tag_dir}: epoch {state.epoch} was already re-split from {earlier['world_size']} rank(s) x "
            f"{earlier['num_workers']} worker(s) onto {change.saved_world} x {change.saved_workers}; another layout "
            f"inside it is not supported. Resume on {change.saved_world} rank(s) with data.num_workers="
            f"{change.saved_workers} until epoch {state.epoch} ends")
    state.extra[RESPLIT] = {"epoch": state.epoch, "world_size": change.saved_world,
                            "num_workers": change.saved_workers, "batch_size": change.saved_batch,
                            "batches": state.batch_in_epoch}
    return (f"[train] epoch {state.epoch}: the {state.batch_in_epoch} batch(es) per rank consumed by "
            f"{change.saved_world} rank(s) x {max(change.saved_workers, 1)} worker(s) stay consumed; the rest of "
            f"the epoch is re-split over {change.world} x {max(change.workers, 1)} (each sample once)")


def resplit_point(state: TrainerState) -> ResplitPoint | None:
    """The loader's ``resplit_from`` while the epoch the layout changed in lasts, else None."""
    point = state.extra.get(RESPLIT)
    if not point or point.get("epoch") != state.epoch:
        return None
    return ResplitPoint(point["world_size"], point["num_workers"], point["batch_size"], point["batches"])


def end_epoch(state: TrainerState) -> None:
    """The re-split epoch is over: later epochs are the new layout's own."""
    point = state.extra.get(RESPLIT)
    if point and point.get("epoch", -1) <= state.epoch:
        state.extra.pop(RESPLIT)
