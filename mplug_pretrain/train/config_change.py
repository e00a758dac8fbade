"""Resuming with a changed config: what may change, checked before the model or the engine is built.

A checkpoint continues the run its tag's ``config.yaml`` describes. A different batch size, accumulation, data
order, schedule length or model would silently skip samples, re-stretch the LR schedule or fail inside
DeepSpeed, so every field that differs from the tag's config is refused, except the harmless ones below
(logging, checkpoint cadence, paths of the run folder, evaluation settings) and the fields the user lists in
``run.allow_config_change`` (a dotted name, or a section such as ``optim``). A different number of ranks is
always refused: DeepSpeed's partitions and the per-rank data positions cannot be re-split.
"""
from __future__ import annotations

import os

import yaml

from mplug_pretrain.config import Config
from mplug_pretrain.config_loader import to_dict
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.train.checkpoint import saved_run_config, saved_world_size

# changes that do not touch what the checkpoint continues (names, or sections / prefixes of names)
HARMLESS = (
    "run.log_every", "run.checkpoint_every_steps", "run.checkpoint_every_minutes", "run.keep_last",
    "run.tensorboard", "run.output_dir", "run.name", "run.max_nonfinite_in_row", "run.inject_nonfinite_at_steps",
    "run.cpu_peak_flops", "run.compile", "run.overwrite", "run.discard_newer", "run.allow_config_change", "run.deterministic",
    "distributed.timeout_minutes", "distributed.backend", "model.grad_checkpointing",
    # files that only initialise weights: the checkpoint holds every weight (a different architecture still
    # differs in model.* sizes, and the strict load names any key that does not fit)
    "init_from", "model.vision.checkpoint_path", "model.text.bert_checkpoint", "model.decoder.bert_checkpoint",
    "eval", "data.val_shards", "caption.val_shards", "caption.stage_cider", "caption.final_eval",
    "vqa.val_shards", "vqa.submission", "retrieval.val_shards", "snli_ve.val_shards", "nlvr2.val_shards",
)


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts / lists -> {dotted name: leaf}; list items as ``name[i]``."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}[{i}]"))
        out[f"{prefix}.__len__"] = len(value)
        return out
    return {prefix: value}


def _covered(name: str, patterns) -> bool:
    return any(name == p or name.startswith((p + ".", p + "[")) for p in patterns)


def changed_fields(saved: dict, new: dict) -> list[str]:
    """Dotted names whose values differ between two config dicts (fields only one side knows are skipped:
    a checkpoint written before a field existed)."""
    a, b = flatten(saved), flatten(new)
    return sorted(name.removesuffix(".__len__") for name in a.keys() & b.keys() if a[name] != b[name])


def refused_changes(saved: dict, cfg: Config) -> list[tuple[str, object, object]]:
    """(field, saved value, new value) of every change neither harmless nor in run.allow_config_change."""
    new = yaml.safe_load(yaml.safe_dump(to_dict(cfg), sort_keys=False))  # the form config.yaml holds
    allowed = (*HARMLESS, *cfg.run.allow_config_change)
    a, b = flatten(saved), flatten(new)
    out = []
    for name in changed_fields(saved, new):
        if not _covered(name, allowed):
            out.append((name, a.get(name, a.get(f"{name}.__len__")), b.get(name, b.get(f"{name}.__len__"))))
    return out


def check_resume_config(cfg: Config, ckpt_dir: str, tag: str, world: int) -> None:
    """Raise ConfigError, naming every refused field, when ``cfg`` on ``world`` ranks cannot continue ``tag``."""
    tag_dir = os.path.join(ckpt_dir, tag)
    saved_world, saved_config = saved_world_size(ckpt_dir, tag), saved_run_config(ckpt_dir, tag)
    if saved_world is not None and saved_world != world:
        raise ConfigError(
            f"{tag_dir}: written by {saved_world} rank(s), this run has {world}; resume it with the same number "
            f"of ranks (mplug pretrain --nproc {saved_world}, or torchrun --nproc_per_node {saved_world})")
    if saved_config is None or not os.path.isfile(saved_config):
        return
    with open(saved_config) as f:
        saved = yaml.safe_load(f) or {}
    refused = refused_changes(saved, cfg)
    if refused:
        listed = "; ".join(f"{name}: {old!r} -> {new!r}" for name, old, new in refused)
        names = ",".join(name for name, _, _ in refused)
        raise ConfigError(
            f"{refused[0][0]}: differs from the checkpoint's config ({saved_config}): {listed}. Resuming with "
            "these changes would not continue the same run (skipped or repeated samples, a re-stretched LR "
            "schedule, or weights that do not fit); use the saved values, start a new run (another run.name), "
            f"or accept the change with run.allow_config_change=[{names}]")


def saved_batch_size(ckpt_dir: str, tag: str) -> int | None:
    """data.batch_size of the config ``tag`` was written under (None when unknown)."""
    saved_config = saved_run_config(ckpt_dir, tag)
    if saved_config is None:
        return None
    with open(saved_config) as f:
        value = ((yaml.safe_load(f) or {}).get("data") or {}).get("batch_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def batch_size_change_note(saved: int | None, new: int, epoch: int, batch_in_epoch: int, world: int) -> str | None:
    """What an accepted data.batch_size change does to the resumed epoch (None when nothing changes).

    The data position is kept in batches (``batch_in_epoch`` of this epoch consumed per rank): the resumed run
    starts its epoch at that batch of the new size, i.e. at sample ``batch_in_epoch * new`` of each rank's share
    instead of ``batch_in_epoch * saved``. A larger batch skips the samples between, a smaller one repeats them;
    the next epochs see every sample once."""
    if saved is None or saved == new or batch_in_epoch == 0:
        return None
    per_rank = batch_in_epoch * abs(new - saved)
    effect = "will not be seen in it" if new > saved else "will be seen twice in it"
    return (f"[train] data.batch_size changed {saved} -> {new} (run.allow_config_change): epoch {epoch} resumes at "
            f"batch {batch_in_epoch} of the new size, sample {batch_in_epoch * new} of each rank's share instead of "
            f"{batch_in_epoch * saved}: {per_rank * world} samples of this epoch ({per_rank} per rank x {world} "
            f"rank(s)) {effect}; the next epochs see every sample once")
