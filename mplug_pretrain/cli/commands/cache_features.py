"""``mplug cache-features --config FILE``: the frozen ViT's features of caption.train_shards on disk (the fast
captioning recipe's stages with ``cached_features``)."""
from __future__ import annotations

import os

from mplug_pretrain.cli.parsing import add_config_args, load_config_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser("cache-features", help="cache the frozen ViT features of caption.train_shards "
                                                     "(fast recipe stages with cached_features)")
    add_config_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from mplug_pretrain.errors import ConfigError
    from mplug_pretrain.tasks.caption.feature_cache import build_feature_cache
    from mplug_pretrain.tasks.caption.model import load_caption_model, training_image_size
    cfg = load_config_from_args(args)
    if not cfg.caption.train_shards:
        raise ConfigError("caption.train_shards: required (the images whose features are cached)")
    if not cfg.init_from:
        raise ConfigError("init_from: required (the model whose frozen ViT computes the features)")
    image_size = training_image_size(cfg)
    model = load_caption_model(cfg.init_from, cfg.model, image_size)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    root = cfg.caption.feature_cache or os.path.join(cfg.run_dir, "feature_cache")
    folder = build_feature_cache(model, cfg.caption.train_shards, root, image_size, cfg.caption.feature_dtype,
                                 batch_size=cfg.eval.batch_size, num_workers=cfg.data.num_workers)
    print(folder)
    return 0
