"""Held-out validation while pretraining (``data.val_shards``, every ``run.eval_every_steps`` and at the end;
train/loop.py calls ``validate`` on every rank, in eval mode, without gradient).

Each rank reads its share of the held-out shards (every sample once over the ranks, no augmentation; at most
``run.val_batches`` batches per rank when set) and computes, per batch:
  - the four pretraining losses of ``MPLUG.forward`` (eval mode: no dropout, the queues are read, never written),
    averaged over the real rows of every rank: val_loss, val_loss_itc, val_loss_itm, val_loss_mlm, val_loss_prefixlm;
  - the ITC features of each image and of its caption (one per sample), gathered over the ranks; then
    image -> text and text -> image recall@1/5 by cosine similarity over the whole held-out set (pessimistic
    ties, metrics/retrieval_recall.py): val_itc_txt_r1/r5, val_itc_img_r1/r5 and their mean R@1, val_itc_r1.
The random draws of the losses (MLM masks, ITM hard negatives) come from a generator seeded by run.seed, in a forked
RNG state: the training stream is untouched (exact resume) and two validations of one model agree.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from mplug_pretrain.config import Config
from mplug_pretrain.metrics.retrieval_recall import retrieval_recall
from mplug_pretrain.models.towers.text import pool_text
from mplug_pretrain.train.block_compile import pad_text
from mplug_pretrain.utils import process_group

LOSS_KEYS = ("loss", "loss_itc", "loss_itm", "loss_mlm", "loss_prefixlm")


def validation_loader(cfg: Config, tokenizer):
    """This rank's share of data.val_shards as pretraining batches (eval transform, no shuffle)."""
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
    spec = LoaderSpec.evaluation(cfg.data.val_shards, cfg.data.batch_size, cfg.data.num_workers,
                                 rank=process_group.rank(), world_size=process_group.world_size())
    return build_pretrain_loader(spec, tokenizer, image_size=cfg.model.vision.image_size,
                                 max_text_len=cfg.data.max_text_len, augment=False)


def _features(module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit-norm ITC features of the images [B, E] and captions [B, E] of one batch (fp32, on the host)."""
    image_feat = module.itc.image_features(module.encode_image(batch["image"])[:, 0])
    text_states = module.encode_text(batch["input_ids"], batch["attention_mask"])
    text_feat = module.itc.text_features(pool_text(text_states, batch["attention_mask"], module.config.itc_pooling))
    return image_feat.float().cpu(), text_feat.float().cpu()


def _gather_rows(rows: np.ndarray) -> np.ndarray:
    """Concatenate every rank's [n_r, E] rows in rank order (n_r may differ)."""
    if process_group.world_size() == 1:
        return rows
    parts: list = [None] * process_group.world_size()
    dist.all_gather_object(parts, rows)
    return np.concatenate(parts)


def _sum_over_ranks(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if process_group.world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def validate(module, cfg: Config, tokenizer) -> dict:
    """-> {"val_loss*": mean over the held-out rows, "val_itc_*": recall in %, "val_samples": rows}."""
    device = next(module.parameters()).device
    sums = [0.0] * len(LOSS_KEYS)
    images, texts = [], []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.run.seed)
        for i, batch in enumerate(validation_loader(cfg, tokenizer)):
            if cfg.run.val_batches and i >= cfg.run.val_batches:
                break
            keep = ~batch["is_pad"]
            if not bool(keep.any()):
                continue
            batch = {k: (v[keep] if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k != "is_pad"}
            batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            if cfg.run.compile:
                batch = pad_text(batch)  # the compiled blocks' static text lengths
            out = module(batch)
            rows = int(keep.sum())
            sums = [s + float(out[k]) * rows for s, k in zip(sums, LOSS_KEYS)]
            image_feat, text_feat = _features(module, batch)
            images.append(image_feat.numpy())
            texts.append(text_feat.numpy())
    count = sum(len(x) for x in images)
    totals = _sum_over_ranks(sums + [float(count)], device)
    n = totals[-1]
    if n == 0:
        from mplug_pretrain.errors import DataError
        raise DataError(f"data.val_shards: no held-out sample was read ({cfg.data.val_shards})")
    metrics = {f"val_{k}": totals[j] / n for j, k in enumerate(LOSS_KEYS)}
    empty = np.zeros((0, module.itc.vision_proj.out_features), dtype=np.float32)
    all_images = _gather_rows(np.concatenate(images) if images else empty)
    all_texts = _gather_rows(np.concatenate(texts) if texts else empty)
    recall = retrieval_recall(all_images @ all_texts.T, np.arange(len(all_texts)), ks=(1, 5))
    metrics.update({f"val_itc_{side}_r{k}": recall[f"{side}_r{k}"] for side in ("txt", "img") for k in (1, 5)})
    metrics["val_itc_r1"] = (recall["txt_r1"] + recall["img_r1"]) / 2
    metrics["val_samples"] = int(n)
    return metrics
