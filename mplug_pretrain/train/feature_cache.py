"""Frozen visual features computed once per image and cached on disk (ExpansionNet v2 §IV-A: in the
frozen-backbone steps "the backbone's forward pass is performed only once for each image").

What is cached: the ViT tokens ``model.image_encoder.vit(image)`` [1 + M, D_vit] of the eval transform
(resize + centre crop, no augmentation). What still runs at every step, with gradient: the projection
and the visual refiner (``states_from_vit_tokens``), the text encoder, fusion and decoder.

A cache folder ``<root>/<fingerprint>/``:
    part-RRR.bin    raw rows, float32 or float16 [N_R, 1 + M, D_vit], written by rank R (read as np.memmap)
    part-RRR.json   {"keys": [...]}: the row order of part R
    meta.json       what was hashed, the row shape, the dtype and the parts; written last (= complete)
Rows are keyed by "<shard>#<image id>" (``cache_key``; the id is ``data.formats.image_id_of``: json
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

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mplug_pretrain.data.epoch_plan import derive_seed
from mplug_pretrain.data.formats import image_id_of
from mplug_pretrain.data.image_decode import SampleError, decode_image, decode_json, decode_text, image_field
from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.data.urls import all_shards, expand_sources
from mplug_pretrain.errors import DataError

DTYPES = {"float32": np.float32, "float16": np.float16}
META = "meta.json"


def states_from_vit_tokens(image_encoder: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The part of ``ImageEncoder.forward`` after the ViT: tokens [B, 1+M, D_vit] -> states [B, 1+M, D]."""
    x = tokens
    if image_encoder.projection is not None:
        x = image_encoder.projection(x)
    if image_encoder.refiner is not None:
        x = image_encoder.refiner(x)
    return x


def cache_key(sample: dict, meta: dict) -> str:
    """"<shard path>#<image id>" of a raw sample (the shard's absolute path when it is a local file)."""
    url = sample.get("__url__", "")
    if "://" not in url and not url.startswith("pipe:"):
        url = os.path.abspath(url)
    return f"{url}#{image_id_of(meta, sample)}"


class CacheInputFormat:
    """What the cache builder reads: image (eval transform) and cache key; ``data.pipeline`` format protocol."""

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


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@torch.no_grad()
def build_feature_cache(model: nn.Module, urls: str, root: str, image_size: int, dtype: str = "float32",
                        batch_size: int = 32, num_workers: int = 0, device: torch.device | str | None = None,
                        log: Callable[[str], None] = print) -> str:
    """Cache ``model.image_encoder.vit`` features of every image of ``urls``; returns the cache folder.
    Nothing is recomputed when a complete cache with the same fingerprint exists. Under torch.distributed
    every rank caches its share of the shards (call it on every rank)."""
    from mplug_pretrain.data.pipeline import build_loader
    from mplug_pretrain.data.transforms import build_eval_transform
    if dtype not in DTYPES:
        raise ValueError(f"caption.feature_dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    vit = model.image_encoder.vit
    digest, described = fingerprint(vit, image_size, dtype, urls)
    folder = os.path.join(root, digest)
    rank, world = _rank_world()
    complete = os.path.isfile(os.path.join(folder, META))
    _barrier()  # nobody writes before every rank has looked
    if complete:
        return folder
    os.makedirs(folder, exist_ok=True)
    device = torch.device(device) if device is not None else next(vit.parameters()).device
    was_training = vit.training
    vit.eval()
    loader = build_loader(urls, CacheInputFormat(build_eval_transform(image_size), image_size), batch_size=batch_size,
                          num_workers=num_workers, mode="exact", shuffle=False, rank=rank, world_size=world)
    keys: list[str] = []
    seen: set[str] = set()
    row_shape = None
    with open(os.path.join(folder, f"part-{rank:03d}.bin"), "wb") as out:
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
    with open(os.path.join(folder, f"part-{rank:03d}.json"), "w") as f:
        json.dump({"keys": keys, "row_shape": row_shape}, f)
    log(f"[cache] rank {rank}: {len(keys)} images cached ({loader.log_line()})")
    _barrier()
    if rank == 0:
        shapes = []
        for r in range(world):
            with open(os.path.join(folder, f"part-{r:03d}.json")) as f:
                shapes.append(json.load(f)["row_shape"])
        shapes = [s for s in shapes if s is not None]
        if not shapes:
            raise DataError(f"{urls}: no image could be cached (every sample was skipped)")
        meta = {"fingerprint": digest, **described, "row_shape": shapes[0], "parts": world}
        tmp = os.path.join(folder, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(folder, META))
        log(f"[cache] complete: {folder}")
    _barrier()
    return folder


class FeatureCache:
    """Read side of a complete cache folder: ``cache.get(key)`` -> float32 array [1 + M, D_vit].
    The part files are memory-mapped lazily (each DataLoader worker maps its own)."""

    def __init__(self, folder: str):
        meta_path = os.path.join(folder, META)
        if not os.path.isfile(meta_path):
            raise DataError(f"{folder}: not a complete feature cache (no {META}); build it with `mplug cache-features`")
        with open(meta_path) as f:
            self.meta = json.load(f)
        self.folder = folder
        self.row_shape = tuple(self.meta["row_shape"])
        self.dtype = DTYPES[self.meta["dtype"]]
        self.rows: dict[str, tuple[int, int]] = {}
        self._counts = []
        for part in range(self.meta["parts"]):
            with open(os.path.join(folder, f"part-{part:03d}.json")) as f:
                keys = json.load(f)["keys"]
            self._counts.append(len(keys))
            for row, key in enumerate(keys):
                self.rows.setdefault(key, (part, row))
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def _part(self, part: int) -> np.memmap:
        if part not in self._maps:
            path = os.path.join(self.folder, f"part-{part:03d}.bin")
            self._maps[part] = np.memmap(path, dtype=self.dtype, mode="r", shape=(self._counts[part], *self.row_shape))
        return self._maps[part]

    def get(self, key: str) -> np.ndarray:
        part, row = self.rows[key]
        return np.array(self._part(part)[row], dtype=np.float32)

    def __getstate__(self) -> dict:  # DataLoader workers map the files themselves
        return {**self.__dict__, "_maps": {}}


class CachedCaptionFormat:
    """Like ``data.formats.ImageTextFormat`` with the image replaced by its cached ViT features.

    Batch: features float32 [B, 1+M, D_vit]; input_ids, attention_mask [B, T]; image_id long [B];
    text list[str]; __key__; is_pad. ``text_fn`` maps the raw caption to the training text.
    A sample whose image is not in the cache (e.g. it was corrupt at caching time) is skipped and counted
    as ``missing_features``."""

    def __init__(self, cache: FeatureCache, tokenizer, max_text_len: int, text_fn: Callable[[str], str]):
        self.cache, self.tokenizer, self.max_text_len, self.text_fn = cache, tokenizer, max_text_len, text_fn

    def decode(self, sample: dict, seed: int) -> dict:
        meta = decode_json(sample.get("json"))
        key = cache_key(sample, meta)
        if key not in self.cache:
            raise SampleError("missing_features", f"{key} is not in the feature cache {self.cache.folder}")
        return {"features": torch.from_numpy(self.cache.get(key)), "image_id": image_id_of(meta, sample),
                "text": self.text_fn(decode_text(sample.get("txt"))), "__key__": sample["__key__"]}

    def blank(self) -> dict:
        return {"features": torch.zeros(self.cache.row_shape), "image_id": -1, "text": self.text_fn(""),
                "__key__": ""}

    def collate(self, samples: list[dict], is_pad: list[bool]) -> dict:
        input_ids, attention_mask = tokenize(self.tokenizer, [s["text"] for s in samples], self.max_text_len)
        return {"features": torch.stack([s["features"] for s in samples]), "input_ids": input_ids,
                "attention_mask": attention_mask,
                "image_id": torch.tensor([s["image_id"] for s in samples], dtype=torch.long),
                "text": [s["text"] for s in samples], "__key__": [s["__key__"] for s in samples],
                "is_pad": torch.tensor(is_pad, dtype=torch.bool)}


def build_cached_loader(urls: str, cache: FeatureCache, tokenizer, text_fn: Callable[[str], str], *,
                        max_text_len: int, batch_size: int, **loader_args):
    """A ``ShardLoader`` of cached-feature caption batches (``loader_args`` as ``data.pipeline.build_loader``)."""
    from mplug_pretrain.data.pipeline import build_loader
    return build_loader(urls, CachedCaptionFormat(cache, tokenizer, max_text_len, text_fn), batch_size=batch_size,
                        **loader_args)


# ----------------------------------------------------------------- `mplug cache-features`
def cmd_cache_features(args) -> int:
    from mplug_pretrain.config import load_config
    from mplug_pretrain.errors import ConfigError
    from mplug_pretrain.train.caption_task import load_caption_model, training_image_size
    cfg = load_config(args.config, args.overrides)
    if not cfg.caption.train_shards:
        raise ConfigError("caption.train_shards: required (the images whose features are cached)")
    if not cfg.init_from:
        raise ConfigError("init_from: required (the model whose frozen ViT computes the features)")
    image_size = training_image_size(cfg)
    model = load_caption_model(cfg.init_from, cfg.model, image_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    root = cfg.caption.feature_cache or os.path.join(cfg.run_dir, "feature_cache")
    folder = build_feature_cache(model, cfg.caption.train_shards, root, image_size, cfg.caption.feature_dtype,
                                 batch_size=cfg.eval.batch_size, num_workers=cfg.data.num_workers)
    print(folder)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("cache-features", help="cache the frozen ViT features of caption.train_shards "
                                                     "(fast recipe stages with cached_features)")
    p.add_argument("--config", required=True, help="YAML run config (configs/caption_*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_cache_features)

