"""Helpers shared by the shard writers for real data: image files, image-id lookup, JSON/JSONL input."""
from __future__ import annotations

import io
import json
import os
import re

from PIL import Image

from mplug_pretrain.data.formats.image_decode import to_rgb
from mplug_pretrain.errors import DataError

IMAGE_EXTS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp", ".bmp": "bmp",
              ".tif": "tiff", ".tiff": "tiff"}
_TRAILING_DIGITS = re.compile(r"(\d+)$")


def read_image_file(path: str, max_side: int | None = None) -> tuple[bytes, str]:
    """(bytes, extension). The file's own bytes, or with ``max_side`` a JPEG (quality 90) whose
    longer side is at most ``max_side`` (smaller images are re-encoded unscaled only if not JPEG/PNG)."""
    ext = IMAGE_EXTS.get(os.path.splitext(path)[1].lower())
    if ext is None:
        raise DataError(f"{path}: not an image file name (known: {sorted(IMAGE_EXTS)})")
    with open(path, "rb") as f:
        data = f.read()
    if max_side is None:
        return data, ext
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as err:  # PIL raises several types for broken files
        raise DataError(f"{path}: unreadable image ({err})") from err
    if max(image.size) <= max_side and ext in ("jpg", "png"):
        return data, ext
    image = to_rgb(image)
    image.thumbnail((max_side, max_side), Image.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue(), "jpg"


def index_images_by_id(folder: str) -> dict[int, str]:
    """{image id: path} from the trailing digits of each image file's stem, which covers COCO 2014
    (``COCO_val2014_000000000042.jpg``), COCO 2017 (``000000000042.jpg``) and easy-vqa (``42.png``)."""
    index: dict[int, str] = {}
    for root, _, files in os.walk(folder):
        for fname in files:
            stem, ext = os.path.splitext(fname)
            match = _TRAILING_DIGITS.search(stem)
            if ext.lower() not in IMAGE_EXTS or not match:
                continue
            image_id = int(match.group(1))
            path = os.path.join(root, fname)
            if image_id in index:
                raise DataError(f"{folder}: image id {image_id} matches both {index[image_id]} and {path}; "
                                "name the files with --image-info (a COCO-style images list) or --image-pattern")
            index[image_id] = path
    if not index:
        raise DataError(f"{folder}: no image files with a numeric id in their name; name the files with "
                        "--image-info (a COCO-style images list) or --image-pattern")
    return index


def index_images_by_name(image_root: str) -> dict[str, str]:
    """{file name: path} of every image under image_root, the first found for a repeated name (NLVR2 keeps its
    images in numbered subfolders; RefCOCO names COCO train2014 files)."""
    index: dict[str, str] = {}
    for root, _, files in os.walk(image_root):
        for fname in files:
            if os.path.splitext(fname)[1].lower() in IMAGE_EXTS:
                index.setdefault(fname, os.path.join(root, fname))
    return index


def load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read JSON ({err})") from err


def load_records(path: str) -> list:
    """A JSON list, or JSON Lines (one object per line): when the file ends in ``.jsonl``, or when its text is not
    one JSON document (NLVR2's ``train.json`` is JSON Lines)."""
    if not path.endswith(".jsonl"):
        try:
            return load_json(path)
        except DataError as err:
            if not isinstance(err.__cause__, json.JSONDecodeError) or "Extra data" not in str(err.__cause__):
                raise
    records = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{line_no}: invalid JSON line ({err})") from err
    return records


def parse_splits(split: str | list[str] | None) -> set[str] | None:
    if split is None:
        return None
    parts = split.split(",") if isinstance(split, str) else list(split)
    return {p.strip() for p in parts if p.strip()}
