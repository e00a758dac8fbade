"""Sample format of visual grounding (shards from data/writers/grounding.py).

Sample: <image ext>; json {"text": referring expression, "bbox": [x, y, w, h] in pixels of the stored image,
"width", "height" (the stored image's size), "ref_id"}.
The image is resized to image_size x image_size without keeping its aspect ratio (no crop can cut the box off),
so the normalised box (x/W, y/H, w/W, h/H) holds in the resized image as it does in the original.
Batch: images float32 [B, 3, S, S]; input_ids, attention_mask long [B, T]; boxes float32 [B, 4] (normalised
xywh); text list[str]; ref_id list[str]; __key__ list[str]; is_pad bool [B].
A sample without a positive-size box inside its image is a SampleError ("bad_box"): skipped and counted.
"""
from __future__ import annotations

import torch
import torchvision.transforms as T

from mplug_pretrain.data.formats.image_decode import (
    SampleError,
    decode_image,
    decode_json,
    decode_text,
    image_field,
)
from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.data.transforms import CLIP_MEAN, CLIP_STD


def grounding_transform(image_size: int) -> T.Compose:
    """Square resize (aspect ratio not kept), tensor, CLIP normalisation."""
    return T.Compose([T.Resize((image_size, image_size), interpolation=T.InterpolationMode.BICUBIC), T.ToTensor(),
                      T.Normalize(CLIP_MEAN, CLIP_STD)])


def normalised_box(meta: dict) -> torch.Tensor:
    """The sample's pixel xywh box / (W, H, W, H); SampleError("bad_box") unless 0 < w, h and the box overlaps
    the image."""
    try:
        x, y, w, h = (float(v) for v in meta["bbox"])
        width, height = float(meta["width"]), float(meta["height"])
    except (KeyError, TypeError, ValueError) as err:
        raise SampleError("bad_box", f"json needs bbox [x, y, w, h], width and height ({err})") from err
    if w <= 0 or h <= 0 or width <= 0 or height <= 0 or x >= width or y >= height or x + w <= 0 or y + h <= 0:
        raise SampleError("bad_box", f"box {meta['bbox']} outside a {width}x{height} image or empty")
    return torch.tensor([x / width, y / height, w / width, h / height], dtype=torch.float32)


class GroundingFormat:
    shard_kinds = ("grounding",)  # the manifest kinds it reads (data/reading/pipeline.check_shard_kind)

    def __init__(self, tokenizer, max_text_len: int, image_size: int):
        self.tokenizer, self.max_text_len, self.image_size = tokenizer, max_text_len, image_size
        self.transform = grounding_transform(image_size)

    def decode(self, sample: dict, seed: int) -> dict:
        meta = decode_json(sample.get("json"))
        box = normalised_box(meta)
        image = self.transform(decode_image(image_field(sample)))
        return {"images": image, "text": decode_text(meta.get("text"), "text"), "boxes": box,
                "ref_id": str(meta.get("ref_id", sample["__key__"])), "__key__": sample["__key__"]}

    def blank(self) -> dict:
        return {"images": torch.zeros(3, self.image_size, self.image_size), "text": "",
                "boxes": torch.tensor([0.0, 0.0, 1.0, 1.0]), "ref_id": "", "__key__": ""}

    def collate(self, samples: list[dict], is_pad: list[bool]) -> dict:
        input_ids, attention_mask = tokenize(self.tokenizer, [s["text"] for s in samples], self.max_text_len)
        return {"images": torch.stack([s["images"] for s in samples]), "input_ids": input_ids,
                "attention_mask": attention_mask, "boxes": torch.stack([s["boxes"] for s in samples]),
                "text": [s["text"] for s in samples], "ref_id": [s["ref_id"] for s in samples],
                "__key__": [s["__key__"] for s in samples], "is_pad": torch.tensor(is_pad, dtype=torch.bool)}
