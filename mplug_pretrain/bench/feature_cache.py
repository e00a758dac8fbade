"""`mplug bench feature-cache`: training step time with the ViT frozen and its features read from the on-disk
cache, against end-to-end training, for the caption XE and SCST steps (ExpansionNet v2 §IV-A, Table VII).

Model: the mPLUG base captioner (ViT-B/16 at 256 px, 257 visual tokens, BERT-base text + fusion, 12-layer
decoder; random init, fp32) or the tiny preset with ``quick``. One step = loss + backward + AdamW step on a
batch of B images (XE: B captions "[CLS] a picture of w_1..w_12 [SEP]"; SCST: B images x 5 samples of at
most 20 tokens, CIDEr-D reward). Modes:
    end_to_end       the ViT trains (forward and backward through it)
    frozen_encoder   the ViT runs under no_grad at every step
    cached_features  the ViT does not run: its features are read from a real feature cache on disk
                     (tasks/caption/feature_cache.py, built once from synthetic shards) and copied into the batch
Rows: mode, objective, seconds_per_step (median), batch_size, trainable_parameters.
``recipe_estimate``: ExpansionNet's 2.8x is an estimate of a whole recipe's time (Table VII). The same
estimate with OUR measured per-sample costs: fast = A 8 XE epochs cached + B 2 XE end-to-end + C 9 SCST
cached + D 1 SCST end-to-end + two caching passes (ViT forward once per image, before A and before C);
standard = 30 XE + 30 SCST epochs end-to-end; an XE epoch is 5 captions per image, an SCST epoch 1 image.
Both at our batch size (the paper's standard recipe used batch 10, which favours the fast one further).
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

from mplug_pretrain.bench.common import median_seconds, write_bench

MODES = ("end_to_end", "frozen_encoder", "cached_features")
FAST_RECIPE = {"xe_cached": 8 * 5, "xe_end_to_end": 2 * 5, "scst_cached": 9, "scst_end_to_end": 1, "caching": 2}
STANDARD_RECIPE = {"xe_end_to_end": 30 * 5, "scst_end_to_end": 30}


def _model(quick: bool):
    from mplug_pretrain.models.presets import get_preset_config
    from mplug_pretrain.tasks.caption.model import captioner
    torch.manual_seed(0)
    return captioner(get_preset_config("tiny" if quick else "base"))


def _cache(model, batch: int, image_size: int, folder: str):
    """A real feature cache of ``batch`` synthetic images; -> (FeatureCache, its keys)."""
    from mplug_pretrain.data.writers.synthetic import write_synthetic_image_shards
    from mplug_pretrain.tasks.caption.cached_features import FeatureCache
    from mplug_pretrain.tasks.caption.feature_cache import build_feature_cache
    shards = os.path.join(folder, "shards")
    entry = write_synthetic_image_shards(shards, num_scenes=batch, captions_per_scene=2, layout="image",
                                        image_size=image_size, name="bench", overwrite=True)
    urls = os.path.join(shards, entry["shards"][0]["file"])
    cache = FeatureCache(build_feature_cache(model, urls, os.path.join(folder, "cache"), image_size,
                                             batch_size=batch, log=lambda line: None))
    return cache, sorted(cache.rows)


def run(out: str, quick: bool = False) -> dict:
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.tasks.caption.data import prompt_ids
    from mplug_pretrain.tasks.caption.losses import scst_batch_loss, xe_batch_loss
    from mplug_pretrain.tasks.caption.scst import CiderDReward
    batch, repeats = (2, 1) if quick else (4, 2)
    model = _model(quick).train()
    size = model.config.vision.image_size
    tokenizer = load_tokenizer()
    prompt = prompt_ids(tokenizer, "a picture of")
    g = torch.Generator().manual_seed(0)
    words = torch.randint(2000, 8000, (batch, 12), generator=g)
    input_ids = torch.cat([prompt[:, :-1].expand(batch, -1), words, torch.full((batch, 1), 102)], dim=1)
    images = torch.randn(batch, 3, size, size, generator=g)
    rows, per_image = [], {}
    with tempfile.TemporaryDirectory() as folder:
        cache, keys = _cache(model, batch, size, folder)
        reward = CiderDReward({i: ["a large red circle on the left", "a small blue square at the top"]
                               for i in range(batch)})
        with torch.no_grad():
            vit_seconds = median_seconds(lambda: model.image_encoder.vit(images), repeats=repeats, warmup=1)
        per_image["caching"] = vit_seconds / batch
        for mode in MODES:
            model.image_encoder.vit.requires_grad_(mode == "end_to_end")
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-6)
            for objective in ("xe", "scst"):
                def step(mode: str = mode, objective: str = objective, optimizer=optimizer) -> None:
                    b = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                         "image_id": torch.arange(batch), "is_pad": torch.zeros(batch, dtype=torch.bool)}
                    if mode == "cached_features":  # the disk read and copy that replaces the ViT
                        b["features"] = torch.from_numpy(np.stack([cache.get(k) for k in keys]))
                    else:
                        b["image"] = images
                    frozen = mode != "end_to_end"
                    if objective == "xe":
                        loss = xe_batch_loss(model, b, frozen, prompt.shape[1] - 1, 0.0)["loss"]
                    else:
                        loss = scst_batch_loss(model, b, frozen, prompt, reward, tokenizer, 5, 20)["loss"]
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                seconds = median_seconds(step, repeats=repeats, warmup=1)
                rows.append({"mode": mode, "objective": objective, "seconds_per_step": seconds, "batch_size": batch,
                             "trainable_parameters": sum(p.numel() for p in params)})
                per_image[f"{objective}_{'cached' if mode == 'cached_features' else mode}"] = seconds / batch
                print(rows[-1], flush=True)
    fast = sum(epochs * per_image[k] for k, epochs in FAST_RECIPE.items())
    standard = sum(epochs * per_image[k] for k, epochs in STANDARD_RECIPE.items())
    speedups = {objective: per_image[f"{objective}_end_to_end"] / per_image[f"{objective}_cached"]
                for objective in ("xe", "scst")}
    return write_bench("feature-cache", rows, out, preset="tiny" if quick else "base", image_size=size,
                       step_speedup_cached_vs_end_to_end=speedups,
                       recipe_estimate={"seconds_per_training_image": {"fast_recipe": fast, "standard_recipe": standard},
                                        "speedup": standard / fast, "fast_epochs": FAST_RECIPE,
                                        "standard_epochs": STANDARD_RECIPE, "per_image_seconds": per_image},
                       threads=torch.get_num_threads())
