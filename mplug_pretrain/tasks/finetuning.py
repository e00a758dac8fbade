"""The resolution a fine-tuning task trains at, shared by captioning and VQA, and the model it starts from."""
from __future__ import annotations

import os

from mplug_pretrain.config import Config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.folder.config_io import CONFIG_FILE, read_model_config


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
