"""The captioner: MPLUG without momentum encoders, pretraining heads frozen, built from a pretrained folder
(with an interchangeable decoder / visual refiner swapped in when the config asks for another type)."""
from __future__ import annotations

import copy
import logging

from torch import nn

from mplug_pretrain.config import Config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.model_config import ModelConfig
from mplug_pretrain.tasks.finetuning import finetune_image_size

log = logging.getLogger(__name__)


def training_image_size(cfg: Config) -> int:
    """caption.image_size, else the pretrained model's, else model.vision.image_size."""
    return finetune_image_size(cfg, cfg.caption.image_size)


def captioner(config: ModelConfig, state: dict | None = None) -> nn.Module:
    """MPLUG without momentum encoders, pretraining heads frozen; ``state`` loaded where its keys fit."""
    from mplug_pretrain.models.mplug import MPLUG
    config = copy.deepcopy(config)
    config.heads.use_momentum = False
    model = MPLUG(config)
    if state is not None:
        own = model.state_dict()
        missing = [k for k in own if k not in state]
        fresh = ("decoder.", "image_encoder.refiner.")
        if any(not k.startswith(fresh) for k in missing):
            raise ConfigError(f"init_from: the pretrained weights lack {missing[0]}")
        model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    for head in (model.itc, model.itm_head, model.mlm_head):
        head.requires_grad_(False)
    return model


def load_caption_model(directory: str, model_cfg: ModelConfig, image_size: int | None = None) -> nn.Module:
    """A captioner from a ``save_pretrained`` folder. The folder's architecture is kept, except that a
    different ``model_cfg.decoder.type`` / ``refiner.type`` swaps in a freshly initialised head of that
    type (the interchangeable decoders: bert | expansion | acf)."""
    from mplug_pretrain.models.mplug import MPLUG
    pretrained = MPLUG.from_pretrained(directory, image_size=image_size)
    config = copy.deepcopy(pretrained.config)
    state = pretrained.state_dict()
    for part, prefix in (("decoder", "decoder."), ("refiner", "image_encoder.refiner.")):
        ours, theirs = getattr(model_cfg, part).type, getattr(config, part).type
        if ours != theirs:
            setattr(config, part, copy.deepcopy(getattr(model_cfg, part)))
            dropped = [k for k in state if k.startswith(prefix)]
            state = {k: v for k, v in state.items() if not k.startswith(prefix)}
            if dropped:
                log.warning("init_from %s: its %s %r (%d tensors) is not loaded: model.%s.type is %r, trained "
                            "from random init (set model.%s.type=%s to keep the pretrained one)", directory, part,
                            theirs, len(dropped), part, ours, part, theirs)
    del pretrained
    return captioner(config, state)
