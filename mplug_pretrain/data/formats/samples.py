"""Sample formats: how one raw tar sample is decoded, how samples become a batch, and what a
blank filler looks like. One class per batch contract; ``is_pad`` bool [B] marks fillers.

ImageTextFormat (pretraining, captioning):
  image float32 [B,3,H,W] (uint8 with image_dtype=torch.uint8: the training loaders, normalised on the device); input_ids, attention_mask long [B,T] (T = longest <= max_text_len);
  image_id long [B]; text list[str]; __key__ list[str]; is_pad bool [B]
VQAFormat:
  image; question_input_ids, question_attention_mask long [B,T]; question list[str];
  answers list[list[str]] (unique, first-seen order); answer_weights list[list[float]]
  (count / number of annotators, as ALBEF/mPLUG); all_answers list[list[str]] (raw, for the VQA
  accuracy); question_id list[int|str]; image_id long [B]; __key__; is_pad
CaptionEvalFormat:
  image; image_id long [B]; captions list[list[str]] (json.captions, else [txt]); text list[str];
  __key__; is_pad
VideoFormat:
  video_bytes list[bytes]; video_ext list[str]; video_id list; captions list[list[str]];
  qa list[list[dict]]; __key__; is_pad; with num_frames also video float32 [B,N,3,H,W]
  (frames from ``data.formats.video_frames.decode_frames``, eval transform per frame).
A sample's augmentation is seeded by (slot seed, raw position), so a resumed loader repeats it.
"""
from __future__ import annotations

import os
from collections import Counter

import torch

from mplug_pretrain.data.formats.image_decode import (
    SampleError,
    decode_image,
    decode_json,
    decode_text,
    image_field,
)
from mplug_pretrain.data.reading.epoch_plan import derive_seed
from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.data.transforms import seeded_transform

VIDEO_EXTENSIONS = ("mp4", "avi", "webm", "mkv", "mov", "m4v")


INT64_MAX = 2**63 - 1


def image_id_of(meta: dict, sample: dict) -> int:
    """json ``image_id`` when it is an integer (or ASCII digits), else img2dataset's json ``key`` ("000010005" ->
    10005); otherwise a stable 62-bit id of the text/key. An integer outside int64 (it could not go into the
    batch's long tensor) raises ``bad_image_id``."""
    value = meta.get("image_id", meta.get("key"))
    if isinstance(value, str) and value.isascii() and value.isdigit():  # "²".isdigit() is True, int("²") fails
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise SampleError("bad_image_id", f"image_id {str(value)[:30]}... does not fit in int64")
        return value
    basis = value if value is not None else (os.path.dirname(sample.get("__url__", "")), sample["__key__"])
    return derive_seed("image_id", basis) >> 1


def json_list(meta: dict, key: str) -> list:
    """``meta[key]`` as a list ([] when absent); any other type is a ``bad_json`` sample."""
    value = meta.get(key, [])
    if not isinstance(value, list):
        raise SampleError("bad_json", f"json {key!r} is a {type(value).__name__}, expected a list")
    return value


class ImageTextFormat:
    shard_kinds = ("image-text",)  # the manifest kinds it reads (data/reading/pipeline.check_shard_kind)

    def __init__(self, transform, tokenizer, max_text_len: int, image_size: int,
                 image_dtype: torch.dtype = torch.float32, draft_side: int | None = None):
        self.transform, self.tokenizer = transform, tokenizer
        self.max_text_len, self.image_size = max_text_len, image_size
        self.image_dtype, self.draft_side = image_dtype, draft_side

    def decode(self, sample: dict, seed: int) -> dict:
        image = decode_image(image_field(sample), self.draft_side)
        text = decode_text(sample.get("txt"))
        meta = decode_json(sample.get("json"))
        return {"image": seeded_transform(self.transform, image, derive_seed(seed, sample["__pos__"])),
                "text": text, "image_id": image_id_of(meta, sample), "__key__": sample["__key__"]}

    def blank(self) -> dict:
        return {"image": torch.zeros(3, self.image_size, self.image_size, dtype=self.image_dtype), "text": "",
                "image_id": -1, "__key__": ""}

    def collate(self, samples: list[dict], is_pad: list[bool]) -> dict:
        input_ids, attention_mask = tokenize(self.tokenizer, [s["text"] for s in samples], self.max_text_len)
        return {"image": torch.stack([s["image"] for s in samples]), "input_ids": input_ids,
                "attention_mask": attention_mask,
                "image_id": torch.tensor([s["image_id"] for s in samples], dtype=torch.long),
                "text": [s["text"] for s in samples], "__key__": [s["__key__"] for s in samples],
                "is_pad": torch.tensor(is_pad, dtype=torch.bool)}


def answer_targets(answers: list[str]) -> tuple[list[str], list[float]]:
    """Unique answers in first-seen order, each weighted by its share of the annotators."""
    counts = Counter(answers)
    unique = list(dict.fromkeys(answers))
    return unique, [counts[a] / len(answers) for a in unique]


class VQAFormat:
    shard_kinds = ("vqa",)  # the manifest kinds it reads (data/reading/pipeline.check_shard_kind)

    def __init__(self, transform, tokenizer, max_text_len: int, image_size: int,
                 image_dtype: torch.dtype = torch.float32, draft_side: int | None = None):
        self.transform, self.tokenizer = transform, tokenizer
        self.max_text_len, self.image_size = max_text_len, image_size
        self.image_dtype, self.draft_side = image_dtype, draft_side

    def decode(self, sample: dict, seed: int) -> dict:
        image = decode_image(image_field(sample), self.draft_side)
        meta = decode_json(sample.get("json"))
        question = decode_text(meta.get("question", sample.get("txt")), "question")
        raw = [str(a.get("answer", "") if isinstance(a, dict) else a).strip() for a in json_list(meta, "answers")]
        unique, weights = answer_targets(raw) if raw else ([], [])
        return {"image": seeded_transform(self.transform, image, derive_seed(seed, sample["__pos__"])),
                "question": question, "answers": unique, "answer_weights": weights, "all_answers": raw,
                "question_id": meta.get("question_id", sample["__key__"]), "image_id": image_id_of(meta, sample),
                "__key__": sample["__key__"]}

    def blank(self) -> dict:
        return {"image": torch.zeros(3, self.image_size, self.image_size, dtype=self.image_dtype), "question": "", "answers": [],
                "answer_weights": [], "all_answers": [], "question_id": -1, "image_id": -1, "__key__": ""}

    def collate(self, samples: list[dict], is_pad: list[bool]) -> dict:
        input_ids, attention_mask = tokenize(self.tokenizer, [s["question"] for s in samples], self.max_text_len)
        batch = {"image": torch.stack([s["image"] for s in samples]), "question_input_ids": input_ids,
                 "question_attention_mask": attention_mask,
                 "image_id": torch.tensor([s["image_id"] for s in samples], dtype=torch.long)}
        for key in ("question", "answers", "answer_weights", "all_answers", "question_id", "__key__"):
            batch[key] = [s[key] for s in samples]
        batch["is_pad"] = torch.tensor(is_pad, dtype=torch.bool)
        return batch


class CaptionEvalFormat:
    shard_kinds = ("image-text",)  # the manifest kinds it reads (data/reading/pipeline.check_shard_kind)

    def __init__(self, transform, image_size: int):
        self.transform, self.image_size = transform, image_size

    def decode(self, sample: dict, seed: int) -> dict:
        image = decode_image(image_field(sample))
        meta = decode_json(sample.get("json"))
        captions = [str(c) for c in json_list(meta, "captions")]
        text = decode_text(sample.get("txt")) if sample.get("txt") is not None or not captions else captions[0]
        return {"image": seeded_transform(self.transform, image, derive_seed(seed, sample["__pos__"])),
                "image_id": image_id_of(meta, sample), "captions": captions or [text], "text": text,
                "__key__": sample["__key__"]}

    def blank(self) -> dict:
        return {"image": torch.zeros(3, self.image_size, self.image_size), "image_id": -1, "captions": [],
                "text": "", "__key__": ""}

    def collate(self, samples: list[dict], is_pad: list[bool]) -> dict:
        return {"image": torch.stack([s["image"] for s in samples]),
                "image_id": torch.tensor([s["image_id"] for s in samples], dtype=torch.long),
                "captions": [s["captions"] for s in samples], "text": [s["text"] for s in samples],
                "__key__": [s["__key__"] for s in samples], "is_pad": torch.tensor(is_pad, dtype=torch.bool)}


class VideoFormat:
    shard_kinds = ("video",)  # the manifest kinds it reads (data/reading/pipeline.check_shard_kind)

    def __init__(self, num_frames: int | None = None, frame_mode: str = "uniform", transform=None,
                 image_size: int | None = None, backend: str = "auto"):
        if num_frames is not None and (transform is None or image_size is None):
            raise ValueError("decoding frames needs a transform and image_size")
        self.num_frames, self.frame_mode, self.backend = num_frames, frame_mode, backend
        self.transform, self.image_size = transform, image_size

    def decode(self, sample: dict, seed: int) -> dict:
        ext = next((e for e in VIDEO_EXTENSIONS if e in sample), None)
        if ext is None:
            raise SampleError("missing_video", "no video field (mp4/avi/...)")
        if not sample[ext]:
            raise SampleError("corrupt_video", "zero-byte video")
        meta = decode_json(sample.get("json"))
        captions = [str(c) for c in json_list(meta, "captions")]
        if not captions and sample.get("txt") is not None:
            captions = [decode_text(sample["txt"])]
        out = {"video_bytes": sample[ext], "video_ext": ext, "video_id": meta.get("video_id", sample["__key__"]),
               "captions": captions, "qa": json_list(meta, "qa"), "__key__": sample["__key__"]}
        if self.num_frames is not None:
            out["video"] = self._frames(sample[ext], seed, sample["__pos__"])
        return out

    def _frames(self, data: bytes, seed: int, pos: int) -> torch.Tensor:
        from PIL import Image

        from mplug_pretrain.data.formats.video_frames import (  # imported when used
            VideoDecodeError,
            decode_frames,
        )
        try:
            frames = decode_frames(data, self.num_frames, mode=self.frame_mode, backend=self.backend)
        except VideoDecodeError as err:
            raise SampleError("corrupt_video", str(err)) from err
        return torch.stack([seeded_transform(self.transform, Image.fromarray(f), derive_seed(seed, pos, i))
                            for i, f in enumerate(frames)])

    def blank(self) -> dict:
        out = {"video_bytes": b"", "video_ext": "", "video_id": -1, "captions": [], "qa": [], "__key__": ""}
        if self.num_frames is not None:
            out["video"] = torch.zeros(self.num_frames, 3, self.image_size, self.image_size)
        return out

    def collate(self, samples: list[dict], is_pad: list[bool]) -> dict:
        batch = {key: [s[key] for s in samples]
                 for key in ("video_bytes", "video_ext", "video_id", "captions", "qa", "__key__")}
        if self.num_frames is not None:
            batch["video"] = torch.stack([s["video"] for s in samples])
        batch["is_pad"] = torch.tensor(is_pad, dtype=torch.bool)
        return batch
