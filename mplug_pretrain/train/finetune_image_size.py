"""The resolution a fine-tuning task trains at, shared by captioning and VQA."""
from __future__ import annotations

import os

from mplug_pretrain.config import Config
from mplug_pretrain.models.config_io import CONFIG_FILE, read_model_config


def finetune_image_size(cfg: Config, task_image_size: int | None) -> int:
    """The task's own setting (caption.image_size / vqa.image_size), else the pretrained model's
    (``init_from``/config.json), else model.vision.image_size."""
    if task_image_size is not None:
        return task_image_size
    if cfg.init_from:
        return read_model_config(os.path.join(cfg.init_from, CONFIG_FILE)).vision.image_size
    return cfg.model.vision.image_size
