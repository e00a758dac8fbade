"""Frozen visual features computed once per image and cached on disk (ExpansionNet v2 §IV-A: in the
frozen-backbone steps "the backbone's forward pass is performed only once for each image").

What is cached: the ViT tokens ``model.image_encoder.vit(image)`` [1 + M, D_vit] of the eval transform
(resize + centre crop, no augmentation). What still runs at every step, with gradient: the projection
and the visual refiner (``models.towers.vision.states_from_vit_tokens``), the text encoder, fusion and decoder.

The folder layout and its read side (``FeatureCache``, ``CachedCaptionFormat``) are in tasks/caption/cached_features.py.
Rows are keyed by "<shard>#<image id>" (``cache_key``; the id is ``data.formats.samples.image_id_of``: json
``image_id``, else a hash of the sample key), so the captions of one image in a pair-layout shard share one
row, and two data sets that number their images alike never share one. The fingerprint hashes the ViT
weights, the input size, the dtype and the shard files (path, size): features of other weights
(ExpansionNet step C after step B fine-tuned the backbone) go to another folder, never mixed up.

``mplug cache-features --config FILE [key=value ...]`` builds the cache of ``caption.train_shards`` for
the model ``init_from`` (at ``caption.image_size``) under ``caption.feature_cache``.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import torch
from torch import nn

from mplug_pretrain.data.formats.image_decode import decode_image, decode_json, image_field
from mplug_pretrain.data.reading.epoch_plan import derive_seed
from mplug_pretrain.data.reading.urls import all_shards, expand_sources
from mplug_pretrain.errors import DataError
from mplug_pretrain.tasks.caption.cached_features import DTYPES, META, cache_key
from mplug_pretrain.utils import process_group
from mplug_pretrain.utils.atomic_files import atomic_write, write_json_atomic


class CacheInputFormat:
    """What the cache builder reads: image (eval transform) and cache key; ``data.reading.pipeline`` format protocol."""

    def __init__(self, transform, image_size: int):
        self.transform, self.image_size = transform, image_size

    def decode(self, sample: dict, seed: int) -> dict:
        from mplug_pretrain.data.transforms import seeded_transform
        image = decode_image(image_field(sample))
        key = cache_key(sample, decode_json(sample.get("json")))
        return {"image": seeded_transform(self.transform, image, derive_seed(seed, sample["__pos__"])), "key": key}

    def blank(self) -> dict:
        return {"image": torch.zeros(3, self.image_size, self.image_size), "key": ""}

    def collate(self, samples: list[dict], is_pad: list[bool]) -> dict:
        return {"image": torch.stack([s["image"] for s in samples]), "key": [s["key"] for s in samples],
                "is_pad": torch.tensor(is_pad, dtype=torch.bool)}


def _shard_files(urls: str) -> list[tuple[str, int]]:
    files = []
    for url in all_shards(expand_sources(urls)):
        path = os.path.abspath(url)
        files.append((path, os.path.getsize(path) if os.path.exists(path) else -1))
    return files


def fingerprint(vit: nn.Module, image_size: int, dtype: str, urls: str) -> tuple[str, dict]:
    """-> (hex digest, the description it hashes besides the weights)."""
    h = hashlib.sha256()
    for name, tensor in sorted(vit.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    described = {"image_size": image_size, "dtype": dtype, "transform": "eval", "shards": _shard_files(urls)}
    h.update(json.dumps(described, sort_keys=True).encode())
    return h.hexdigest()[:20], described


@torch.no_grad()
def build_feature_cache(model: nn.Module, urls: str, root: str, image_size: int, dtype: str = "float32",
                        batch_size: int = 32, num_workers: int = 0, device: torch.device | str | None = None,
                        log: Callable[[str], None] = print) -> str:
    """Cache ``model.image_encoder.vit`` features of every image of ``urls``; returns the cache folder.
    Nothing is recomputed when a complete cache with the same fingerprint exists. Under torch.distributed
    every rank caches its share of the shards (call it on every rank)."""
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_loader
    from mplug_pretrain.data.transforms import build_eval_transform
    if dtype not in DTYPES:
        raise ValueError(f"caption.feature_dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    vit = model.image_encoder.vit
    digest, described = fingerprint(vit, image_size, dtype, urls)
    folder = os.path.join(root, digest)
    rank, world = process_group.rank(), process_group.world_size()
    complete = os.path.isfile(os.path.join(folder, META))
    process_group.barrier()  # nobody writes before every rank has looked
    if complete:
        return folder
    os.makedirs(folder, exist_ok=True)
    device = torch.device(device) if device is not None else next(vit.parameters()).device
    was_training = vit.training
    vit.eval()
    loader = build_loader(LoaderSpec.evaluation(urls, batch_size, num_workers, rank=rank, world_size=world),
                          CacheInputFormat(build_eval_transform(image_size), image_size))
    keys: list[str] = []
    seen: set[str] = set()
    row_shape = None
    with atomic_write(os.path.join(folder, f"part-{rank:03d}.bin"), "wb") as out:
        for batch in loader:
            keep = []
            for i, (pad, key) in enumerate(zip(batch["is_pad"].tolist(), batch["key"])):
                if not pad and key not in seen:  # pair-layout shards repeat an image per caption
                    seen.add(key)
                    keep.append(i)
            if not keep:
                continue
            tokens = vit(batch["image"][keep].to(device, torch.float32))
            out.write(tokens.cpu().numpy().astype(DTYPES[dtype]).tobytes())
            keys.extend(batch["key"][i] for i in keep)
            row_shape = list(tokens.shape[1:])
    vit.train(was_training)
    write_json_atomic(os.path.join(folder, f"part-{rank:03d}.json"), {"keys": keys, "row_shape": row_shape}, indent=None)
    log(f"[cache] rank {rank}: {len(keys)} images cached ({loader.log_line()})")
    process_group.barrier()
    if rank == 0:
        shapes = []
        for r in range(world):
            with open(os.path.join(folder, f"part-{r:03d}.json")) as f:
                shapes.append(json.load(f)["row_shape"])
        shapes = [s for s in shapes if s is not None]
        if not shapes:
            raise DataError(f"{urls}: no image could be cached (every sample was skipped)")
        meta = {"fingerprint": digest, **described, "row_shape": shapes[0], "parts": world}
        write_json_atomic(os.path.join(folder, META), meta, indent=1)
        log(f"[cache] complete: {folder}")
    process_group.barrier()
    return folder
