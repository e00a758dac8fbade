"""The steps every fine-tuning task shares: the training shards swapped into ``cfg.data``, the resolution and the
model a task starts from, which parts are frozen, held-out validation while training and the evaluation after the
last step."""
from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable

from torch import nn

from mplug_pretrain.config import Config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.folder.config_io import CONFIG_FILE, read_model_config
from mplug_pretrain.utils import process_group


def with_task_shards(cfg: Config, section: str, command: str, what: str) -> Config:
    """``cfg`` whose ``data.train_shards`` are ``<section>.train_shards`` (the loop reads data.train_shards;
    ``data.train_weights`` weigh pretraining sources: none here). ConfigError naming the field when it is unset;
    ``what`` says which shards and how to make them."""
    shards = getattr(cfg, section).train_shards
    if not shards:
        raise ConfigError(f"{section}.train_shards: required by `mplug finetune {command}` ({what})")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_shards=shards, train_weights=None))


def finetune_image_size(cfg: Config, task_image_size: int | None) -> int:
    """The task's own setting (caption.image_size / vqa.image_size), else the pretrained model's
    (``init_from``/config.json), else model.vision.image_size."""
    if task_image_size is not None:
        return task_image_size
    if cfg.init_from:
        return read_model_config(os.path.join(cfg.init_from, CONFIG_FILE)).vision.image_size
    return cfg.model.vision.image_size


def initial_model(cfg: Config, section: str, task_image_size: int | None):
    """The model a fine-tuning task starts from: ``init_from`` (ViT positions resized to ``task_image_size``
    when given), else a fresh ``MPLUG(cfg.model)``; ``<section>.image_size`` without init_from must equal
    model.vision.image_size (it only re-targets a pretrained model)."""
    from mplug_pretrain.models.mplug import MPLUG
    if cfg.init_from:
        return MPLUG.from_pretrained(cfg.init_from, image_size=task_image_size)
    if task_image_size is not None and task_image_size != cfg.model.vision.image_size:
        raise ConfigError(f"{section}.image_size: only re-targets a pretrained model (init_from); without one "
                          "set model.vision.image_size")
    return MPLUG(cfg.model)


def freeze_pretraining_heads(model: nn.Module) -> nn.Module:
    """ITC projections/temperature, ITM and MLM heads get no gradient in a fine-tuning task that does not use
    them: keep them out of the optimizer."""
    for head in (model.itc, model.itm_head, model.mlm_head):
        head.requires_grad_(False)
    return model


def freeze_parts(model: nn.Module, names: list[str]) -> nn.Module:
    """``<task>.freeze``: no gradient and eval mode (no dropout) for these parts. Applied once when the model is
    built; the training loop never calls ``.train()`` again, which would switch their dropout back on."""
    for name in names:
        getattr(model, name).requires_grad_(False).eval()
    return model


def evaluate_exported_model(cfg: Config, tokenizer, evaluate_model: Callable[..., dict]) -> dict:
    """Rank 0 reloads ``<run_dir>/model`` (full precision, whatever the ZeRO stage) and runs
    ``evaluate_model(model, cfg, tokenizer, <run_dir>/metrics.json, checkpoint=<run_dir>/model)``; the other
    ranks wait for it and return {}."""
    from mplug_pretrain.models.mplug import MPLUG
    from mplug_pretrain.utils.process_group import barrier, rank
    metrics: dict = {}
    if rank() == 0:
        model_dir = os.path.join(cfg.run_dir, "model")
        metrics = evaluate_model(MPLUG.from_pretrained(model_dir), cfg, tokenizer,
                                 os.path.join(cfg.run_dir, "metrics.json"), checkpoint=model_dir)
    barrier()
    return metrics


def periodic_validation(cfg: Config, section: str, metrics_of: Callable[[nn.Module, Config, str], dict]):
    """``TrainTask.validate`` of a fine-tuning task: the task's held-out metrics of the live model every
    run.eval_every_steps optimizer steps and after the last, logged as ``val_<metric>`` as pretraining's are (with
    <run>/best/ kept by run.best_metric). None unless run.eval_every_steps > 0 and ``<section>.val_shards`` is set:
    without it, the evaluation of the final model after training is the only one.
    ``metrics_of(module, cfg, out)`` evaluates the whole of the val shards, the same on every rank (every rank the
    whole set: the wall time of one rank alone, and under ZeRO-3 every rank takes part in each forward anyway);
    rank 0's report goes to <run>/val/metrics.json (the latest), the other ranks' to a scratch folder."""
    if not cfg.run.eval_every_steps or not getattr(cfg, section).val_shards:
        return None

    def validate(module: nn.Module, cfg: Config) -> dict:
        if process_group.rank() == 0:
            folder = os.path.join(cfg.run_dir, "val")
            os.makedirs(folder, exist_ok=True)
            metrics = metrics_of(module, cfg, os.path.join(folder, "metrics.json"))
        else:
            with tempfile.TemporaryDirectory() as folder:
                metrics = metrics_of(module, cfg, os.path.join(folder, "metrics.json"))
        return {f"val_{name}": float(value) for name, value in metrics.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)}

    return validate
