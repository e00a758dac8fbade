"""``make-shards coco``: image-caption shards from a COCO-style caption JSON + an image folder.

Two input formats are recognised:
  * COCO annotations (``captions_train2014.json``): ``images[{id, file_name}]`` +
    ``annotations[{image_id, caption, id}]``; image path ``IMAGE_ROOT/file_name``.
  * Karpathy ``dataset_coco.json``: ``images[{cocoid|imgid, filepath, filename, split,
    sentences[{raw}]}]``; ``split`` selects e.g. ``"test"`` or ``"train,restval"``; image path
    ``IMAGE_ROOT/filepath/filename``.
Layout ``pair``: one sample per caption (key ``{image_id:012d}_{j}``, json: image_id, caption_id,
file_name); ``image``: one per image (key ``{image_id:012d}``, ``txt`` = first caption,
``json.captions`` = all references, for caption evaluation).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from mplug_pretrain.data.writers.common import load_json, parse_splits, read_image_file
from mplug_pretrain.data.writers.shard_writer import ShardWriter, created_by
from mplug_pretrain.errors import DataError

LAYOUTS = ("pair", "image")


@dataclass
class CaptionedImage:
    image_id: int
    path: str
    captions: list[str] = field(default_factory=list)
    caption_ids: list = field(default_factory=list)
    origin: str = ""  # where the image is named, for messages ("table.csv: row 3"); default "image ID"


def load_caption_json(annotations: str, image_root: str, split: str | list[str] | None = None) -> list[CaptionedImage]:
    data = load_json(annotations)
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, list):
        raise DataError(f"{annotations}: expected an object with an 'images' list (COCO or Karpathy format)")
    if images and "sentences" in images[0]:
        return _karpathy(annotations, images, image_root, parse_splits(split))
    if split is not None:
        raise DataError(f"{annotations}: split selection ({split!r}) applies to Karpathy files "
                        "(dataset_coco.json); COCO annotation files are one split each")
    return _coco(annotations, data, image_root)


def _karpathy(path: str, images: list, image_root: str, splits: set[str] | None) -> list[CaptionedImage]:
    out = []
    for i, img in enumerate(images):
        if splits is not None and img.get("split") not in splits:
            continue
        try:
            image_id = int(img["cocoid"] if "cocoid" in img else img["imgid"])
            file_path = os.path.join(image_root, img.get("filepath", ""), img["filename"])
            captions = [s["raw"].strip() for s in img["sentences"]]
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{path}: images[{i}]: missing or bad field {err}") from err
        out.append(CaptionedImage(image_id, file_path, captions, [s.get("sentid", j) for j, s in
                                                                  enumerate(img["sentences"])]))
    if not out:
        raise DataError(f"{path}: no image in split(s) {sorted(splits or [])}; "
                        f"present: {sorted({str(img.get('split')) for img in images})}")
    return out


def _coco(path: str, data: dict, image_root: str) -> list[CaptionedImage]:
    if not isinstance(data.get("annotations"), list):
        raise DataError(f"{path}: COCO format needs an 'annotations' list")
    by_id: dict[int, CaptionedImage] = {}
    for i, img in enumerate(data["images"]):
        try:
            by_id[int(img["id"])] = CaptionedImage(int(img["id"]), os.path.join(image_root, img["file_name"]))
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{path}: images[{i}]: missing or bad field {err}") from err
    for i, ann in enumerate(data["annotations"]):
        try:
            entry = by_id[int(ann["image_id"])]
            entry.captions.append(str(ann["caption"]).strip())
            entry.caption_ids.append(ann.get("id", len(entry.caption_ids)))
        except KeyError as err:
            raise DataError(f"{path}: annotations[{i}]: missing field or unknown image_id {err}") from err
    return [img for img in by_id.values() if img.captions]


def write_captioned_images(images: list[CaptionedImage], out: str, *, name: str, layout: str, description: str,
                           max_image_side: int | None = None, skip_missing: bool = False,
                           max_samples: int = 1000, max_bytes: int | None = None, overwrite: bool = False) -> dict:
    """Shared by the COCO and table writers."""
    if layout not in LAYOUTS:
        raise DataError(f"layout {layout!r} not in {LAYOUTS}")
    missing = 0
    with ShardWriter(out, name, kind="image-text", created_by=created_by(description), max_samples=max_samples,
                     max_bytes=max_bytes, overwrite=overwrite, extra={"layout": layout}) as writer:
        for img in images:
            if not os.path.exists(img.path):
                if not skip_missing:
                    raise DataError(f"{img.origin or f'image {img.image_id}'}: file not found: {img.path} "
                                    "(skip with --skip-missing)")
                missing += 1
                continue
            data, ext = read_image_file(img.path, max_image_side)
            file_name = os.path.basename(img.path)
            if layout == "image":
                writer.write({"__key__": f"{img.image_id:012d}", ext: data, "txt": img.captions[0],
                              "json": {"image_id": img.image_id, "file_name": file_name, "captions": img.captions,
                                       "caption_ids": img.caption_ids}})
                continue
            for j, (caption, caption_id) in enumerate(zip(img.captions, img.caption_ids)):
                writer.write({"__key__": f"{img.image_id:012d}_{j}", ext: data, "txt": caption,
                              "json": {"image_id": img.image_id, "caption_id": caption_id, "file_name": file_name}})
        writer.extra["skipped_missing"] = missing
    return writer.entry


def write_coco_shards(annotations: str, image_root: str, out: str, *, split: str | list[str] | None = None,
                      layout: str = "pair", name: str = "coco", max_image_side: int | None = None,
                      skip_missing: bool = False, max_samples: int = 1000, max_bytes: int | None = None,
                      overwrite: bool = False) -> dict:
    """Returns the manifest entry (shards, per-shard counts, total, skipped_missing)."""
    images = load_caption_json(annotations, image_root, split)
    description = f"make-shards coco --annotations {annotations} --split {split} --layout {layout}"
    return write_captioned_images(images, out, name=name, layout=layout, description=description,
                                  max_image_side=max_image_side, skip_missing=skip_missing,
                                  max_samples=max_samples, max_bytes=max_bytes, overwrite=overwrite)
