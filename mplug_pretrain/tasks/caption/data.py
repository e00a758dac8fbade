"""Caption training data: the training text ("<prompt> <clean caption>"), the image-caption batch format,
and the training references {image_id: [captions]} the SCST reward scores against."""
from __future__ import annotations

import os
import tarfile
from collections.abc import Callable

import torch

from mplug_pretrain.config import Config
from mplug_pretrain.data.formats.samples import ImageTextFormat, image_id_of
from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.errors import DataError
from mplug_pretrain.tasks.caption.text import clean_caption


class CaptionText:
    """Raw caption -> training text "<prompt> <caption>" (caption cleaned when ``clean``)."""

    def __init__(self, prompt: str, clean: bool = True):
        self.prompt, self.clean = prompt.strip(), clean

    def __call__(self, caption: str) -> str:
        caption = clean_caption(caption) if self.clean else caption.strip()
        return f"{self.prompt} {caption}".strip()


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """"[CLS] prompt [SEP]" ids [1, P]."""
    return tokenize(tokenizer, [prompt], 512)[0]


class CaptionImageFormat(ImageTextFormat):
    """``ImageTextFormat`` with the training text built by ``text_fn`` (prompt + cleaned caption)."""

    def __init__(self, transform, tokenizer, max_text_len: int, image_size: int, text_fn: Callable[[str], str]):
        super().__init__(transform, tokenizer, max_text_len, image_size)
        self.text_fn = text_fn

    def decode(self, sample: dict, seed: int) -> dict:
        out = super().decode(sample, seed)
        out["text"] = self.text_fn(out["text"])
        return out

    def blank(self) -> dict:
        return {**super().blank(), "text": self.text_fn("")}


def _tar_samples(url: str):
    """(key, {ext: bytes}) of a tar's txt/json members, grouped like webdataset (key = name up to the first dot)."""
    current, fields = None, {}
    with tarfile.open(url, "r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            folder, base = os.path.split(member.name)
            key, _, ext = base.partition(".")
            key = os.path.join(folder, key) if folder else key
            if key != current:
                if current is not None:
                    yield current, fields
                current, fields = key, {}
            if ext in ("txt", "json"):
                fields[ext] = tar.extractfile(member).read()
    if current is not None:
        yield current, fields


def load_references(cfg: Config) -> dict[int, list[str]]:
    """Training references {image_id: [captions]} for the SCST reward and its document frequencies:
    caption.coco_json (Karpathy train + restval), else a scan of caption.train_shards' txt/json (no image
    is decoded; ids as the loader computes them)."""
    c = cfg.caption
    if c.coco_json:
        from mplug_pretrain.data.writers.coco import load_caption_json
        images = load_caption_json(c.coco_json, c.image_root or "", "train,restval")
        return {img.image_id: list(img.captions) for img in images}
    from mplug_pretrain.data.formats.image_decode import SampleError, decode_json, decode_text
    from mplug_pretrain.data.reading.urls import all_shards, expand_sources
    refs: dict[int, list[str]] = {}
    for url in all_shards(expand_sources(c.train_shards)):
        for key, fields in _tar_samples(url):
            try:
                meta = decode_json(fields.get("json"))
                captions = [str(x) for x in meta.get("captions", [])] or [decode_text(fields.get("txt"))]
            except SampleError:
                continue  # the loader skips this sample too
            refs.setdefault(image_id_of(meta, {"__key__": key, "__url__": url}), []).extend(captions)
    if not refs:
        raise DataError(f"caption.train_shards: no caption found in {c.train_shards}")
    return refs
