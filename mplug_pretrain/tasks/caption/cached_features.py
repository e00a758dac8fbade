"""Read side of the frozen-feature cache (written by ``tasks/caption/feature_cache.py``): the row key of a sample,
the memory-mapped cache folder, and the caption format whose "image" is the image's cached ViT tokens.

A cache folder ``<root>/<fingerprint>/``:
    part-RRR.bin    raw rows, float32 or float16 [N_R, 1 + M, D_vit], written by rank R (read as np.memmap)
    part-RRR.json   {"keys": [...]}: the row order of part R
    meta.json       what was hashed, the row shape, the dtype and the parts; written last (= complete)
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import torch

from mplug_pretrain.data.formats.image_decode import SampleError, decode_json, decode_text
from mplug_pretrain.data.formats.samples import image_id_of
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.errors import DataError

DTYPES = {"float32": np.float32, "float16": np.float16}
META = "meta.json"


def cache_key(sample: dict, meta: dict) -> str:
    """"<shard path>#<image id>" of a raw sample (the shard's absolute path when it is a local file)."""
    url = sample.get("__url__", "")
    if "://" not in url and not url.startswith("pipe:"):
        url = os.path.abspath(url)
    return f"{url}#{image_id_of(meta, sample)}"


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
    """Like ``data.formats.samples.ImageTextFormat`` with the image replaced by its cached ViT features.

    Batch: features float32 [B, 1+M, D_vit]; input_ids, attention_mask [B, T]; image_id long [B];
    text list[str]; __key__; is_pad. ``text_fn`` maps the raw caption to the training text.
    A sample whose image is not in the cache (e.g. it was corrupt at caching time) is skipped and counted
    as ``missing_features``."""

    shard_kinds = ("image-text",)  # the manifest kinds it reads (data/reading/pipeline.check_shard_kind)

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


def build_cached_loader(spec: LoaderSpec, cache: FeatureCache, tokenizer, text_fn: Callable[[str], str],
                        max_text_len: int):
    """A ``ShardLoader`` of cached-feature caption batches over the shards of ``spec``."""
    from mplug_pretrain.data.reading.pipeline import build_loader
    return build_loader(spec, CachedCaptionFormat(cache, tokenizer, max_text_len, text_fn))
