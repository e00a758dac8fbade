"""Sample format of the classification tasks (SNLI-VE, NLVR2; shards from data/writers/classification.py).

ClassificationFormat(images=1): the sample's image;  images=2: its ``left.<ext>`` and ``right.<ext>`` images.
Batch: images float32 [B, I, 3, H, W]; input_ids, attention_mask long [B, T] (the statement); label long [B]
(index into ``labels``; -1 for fillers); sentence list[str]; __key__ list[str]; is_pad bool [B].
A sample whose label is not one of ``labels`` is a SampleError ("bad_label"): skipped and counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mplug_pretrain.data.formats.image_decode import (
    IMAGE_EXTENSIONS,
    SampleError,
    decode_image,
    decode_json,
    decode_text,
    image_field,
)
from mplug_pretrain.data.reading.epoch_plan import derive_seed
from mplug_pretrain.data.synthetic.statements import NLVR2_LABELS, SNLI_VE_LABELS
from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.data.transforms import seeded_transform

SIDES = ("left", "right")


@dataclass(frozen=True)
class ClassificationTask:
    """What distinguishes SNLI-VE from NLVR2: the CLI name, the config section, the labels (index = class id), the
    images per example."""
    name: str
    section: str
    labels: tuple[str, ...]
    images: int


TASKS = {"snli-ve": ClassificationTask("snli-ve", "snli_ve", SNLI_VE_LABELS, 1),
         "nlvr2": ClassificationTask("nlvr2", "nlvr2", NLVR2_LABELS, 2)}


def side_image(sample: dict, side: str) -> bytes | None:
    """The bytes of ``<side>.<image ext>`` (NLVR2 pairs), else None."""
    return next((sample[f"{side}.{ext}"] for ext in IMAGE_EXTENSIONS if f"{side}.{ext}" in sample), None)


class ClassificationFormat:
    shard_kinds = ("classification",)  # the manifest kinds it reads (data/reading/pipeline.check_shard_kind)

    def __init__(self, transform, tokenizer, max_text_len: int, image_size: int, labels: tuple[str, ...],
                 images: int = 1):
        if images not in (1, 2):
            raise ValueError(f"images: expected 1 or 2, got {images}")
        self.transform, self.tokenizer, self.labels, self.images = transform, tokenizer, tuple(labels), images
        self.max_text_len, self.image_size = max_text_len, image_size

    def decode(self, sample: dict, seed: int) -> dict:
        meta = decode_json(sample.get("json"))
        label = str(meta.get("label"))
        if label not in self.labels:
            raise SampleError("bad_label", f"label {meta.get('label')!r} not in {self.labels}")
        raw = [image_field(sample)] if self.images == 1 else [side_image(sample, side) for side in SIDES]
        base = derive_seed(seed, sample["__pos__"])
        images = [seeded_transform(self.transform, decode_image(data), derive_seed(base, j))
                  for j, data in enumerate(raw)]
        return {"images": torch.stack(images), "sentence": decode_text(meta.get("sentence"), "sentence"),
                "label": self.labels.index(label), "__key__": sample["__key__"]}

    def blank(self) -> dict:
        return {"images": torch.zeros(self.images, 3, self.image_size, self.image_size), "sentence": "",
                "label": -1, "__key__": ""}

    def collate(self, samples: list[dict], is_pad: list[bool]) -> dict:
        input_ids, attention_mask = tokenize(self.tokenizer, [s["sentence"] for s in samples], self.max_text_len)
        return {"images": torch.stack([s["images"] for s in samples]), "input_ids": input_ids,
                "attention_mask": attention_mask, "label": torch.tensor([s["label"] for s in samples]),
                "sentence": [s["sentence"] for s in samples], "__key__": [s["__key__"] for s in samples],
                "is_pad": torch.tensor(is_pad, dtype=torch.bool)}
