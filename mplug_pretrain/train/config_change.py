"""Resuming with a changed config: what may change, checked before the model or the engine is built.

A checkpoint continues the run its tag's ``config.yaml`` describes. A different batch size, accumulation, data
order, schedule length or model would silently skip samples, re-stretch the LR schedule or fail inside
DeepSpeed, so every field that differs from the tag's config is refused, except the harmless ones below
(logging, checkpoint cadence, paths of the run folder, evaluation settings) and the fields the user lists in
``run.allow_config_change`` (a dotted name, or a section such as ``optim``). Another number of ranks, ZeRO stage
or loader-worker count is a change of layout, not of the run (train/world_change.py): the global batch is kept
(the per-rank batch or accumulation re-derived), the rest of the epoch and the optimizer state are re-split.
"""
from __future__ import annotations

import os

import yaml

from mplug_pretrain.config import Config
from mplug_pretrain.config_loader import to_dict
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.train.checkpoint import saved_run_config

# changes that do not touch what the checkpoint continues (names, or sections / prefixes of names)
HARMLESS = (
    "run.log_every", "run.checkpoint_every_steps", "run.checkpoint_every_minutes", "run.keep_last",
    "run.tensorboard", "run.plot_losses", "run.output_dir", "run.name", "run.max_nonfinite_in_row",
    "run.inject_nonfinite_at_steps",
    "run.cpu_peak_flops", "run.compile", "run.overwrite", "run.discard_newer", "run.allow_config_change", "run.deterministic",
    "run.record_sample_keys",
    "distributed.timeout_minutes", "distributed.backend", "distributed.rank_start", "model.grad_checkpointing",
    # the layout: the checkpoint is re-split onto it (train/world_change.py)
    "distributed.zero_stage", "data.num_workers",
    # files that only initialise weights: the checkpoint holds every weight (a different architecture still
    # differs in model.* sizes, and the strict load names any key that does not fit)
    "init_from", "model.vision.checkpoint_path", "model.text.bert_checkpoint", "model.decoder.bert_checkpoint",
    "eval", "data.val_shards", "caption.val_shards", "caption.stage_cider", "caption.final_eval",
    "vqa.val_shards", "vqa.submission", "retrieval.val_shards", "snli_ve.val_shards", "nlvr2.val_shards",
)


BATCH_FIELDS = ("data.batch_size", "optim.grad_accum_steps")  # re-derived on another rank count (world_change)


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


def covered(name: str, patterns) -> bool:
    return any(name == p or name.startswith((p + ".", p + "[")) for p in patterns)


def changed_fields(saved: dict, new: dict) -> list[str]:
    """Dotted names whose values differ between two config dicts (fields only one side knows are skipped:
    a checkpoint written before a field existed)."""
    a, b = flatten(saved), flatten(new)
    return sorted(name.removesuffix(".__len__") for name in a.keys() & b.keys() if a[name] != b[name])


def refused_changes(saved: dict, cfg: Config, layout: tuple[str, ...] = ()) -> list[tuple[str, object, object]]:
    """(field, saved value, new value) of every change neither harmless, nor in run.allow_config_change, nor a
    field of the ``layout`` re-derived for another rank count."""
    new = yaml.safe_load(yaml.safe_dump(to_dict(cfg), sort_keys=False))  # the form config.yaml holds
    allowed = (*HARMLESS, *cfg.run.allow_config_change, *layout)
    a, b = flatten(saved), flatten(new)
    out = []
    for name in changed_fields(saved, new):
        if not covered(name, allowed):
            out.append((name, a.get(name, a.get(f"{name}.__len__")), b.get(name, b.get(f"{name}.__len__"))))
    return out


def check_resume_config(cfg: Config, ckpt_dir: str, tag: str, batch_rederived: bool = False) -> None:
    """Raise ConfigError, naming every refused field, when ``cfg`` cannot continue ``tag``. ``batch_rederived``:
    train/world_change.py set the per-rank batch and accumulation so that the global batch stays the
    checkpoint's (another rank count)."""
    saved_config = saved_run_config(ckpt_dir, tag)
    if saved_config is None or not os.path.isfile(saved_config):
        return
    with open(saved_config) as f:
        saved = yaml.safe_load(f) or {}
    refused = refused_changes(saved, cfg, BATCH_FIELDS if batch_rederived else ())
    if refused:
        listed = "; ".join(f"{name}: {old!r} -> {new!r}" for name, old, new in refused)
        names = ",".join(name for name, _, _ in refused)
        raise ConfigError(
            f"{refused[0][0]}: differs from the checkpoint's config ({saved_config}): {listed}. Resuming with "
            "these changes would not continue the same run (skipped or repeated samples, a re-stretched LR "
            "schedule, or weights that do not fit); use the saved values, start a new run (another run.name), "
            f"or accept the change with run.allow_config_change=[{names}]")
