"""``make-shards grounding``: visual grounding shards (kind "grounding"), from RefCOCO / RefCOCO+ / RefCOCOg
annotations or from synthetic scenes (data/synthetic/referring.py). Sample layout: tasks/grounding/data.py.

Annotation forms read:
  refer      ``--refs`` (the refer toolkit's refs list: {"ref_id", "ann_id", "image_id", "split", "sentences":
             [{"sent"}]}) + ``--instances`` (its COCO instances.json: image file names and the annotation boxes,
             xywh pixels) + ``--split``: one sample per sentence of each ref of the split (val / testA / testB ...).
             ``--refs`` is JSON, or the toolkit's ``refs(unc).p`` pickle read with an unpickler that builds
             builtin containers only (dict, list, str, numbers) and refuses any class or function reference, so a
             crafted file cannot run code.
  records    ``--annotations``: JSON list / JSON Lines of {"image" | "file_name", "text" | "sentence" |
             "caption", "bbox": [x, y, w, h]} (boxes given), or ALBEF's grounding files ({"image", "text",
             "ref_id"}: boxes looked up through --refs and --instances).
Images are found under ``image_root`` by their path, else by file name anywhere below it.
"""
from __future__ import annotations

import os
import pickle

import numpy as np
from PIL import Image

from mplug_pretrain.data.synthetic.referring import referring_expression
from mplug_pretrain.data.synthetic.scenes import encode_jpeg, render_scene, sample_scene
from mplug_pretrain.data.writers.common import index_images_by_name, load_json, load_records, read_image_file
from mplug_pretrain.data.writers.shard_writer import ShardWriter, created_by
from mplug_pretrain.errors import DataError


def _writer(out: str, name: str, description: str, **sizes) -> ShardWriter:
    return ShardWriter(out, name, kind="grounding", created_by=created_by(description), **sizes)


def write_synthetic_grounding(out: str, *, num: int, seed: int = 0, image_size: int = 64, name: str = "grounding",
                              **sizes) -> dict:
    """``num`` (scene, referring expression, box) samples."""
    description = f"make-shards grounding --synthetic --num {num} --seed {seed} --image-size {image_size}"
    with _writer(out, name, description, **sizes) as writer:
        for i in range(num):
            rng = np.random.default_rng([seed, i])
            scene = sample_scene(rng, image_size)
            text, box = referring_expression(scene, rng)
            writer.write({"__key__": f"{i:08d}", "jpg": encode_jpeg(render_scene(scene, rng)),
                          "json": {"text": text, "bbox": box, "width": image_size, "height": image_size,
                                   "ref_id": str(i), "scene": scene.to_json()}})
    return writer.entry


class _BuiltinsOnly(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers; any class or function reference is refused."""

    def find_class(self, module: str, name: str):
        raise DataError(f"refuses to unpickle {module}.{name}: only builtin containers, strings and numbers are read "
                        "from a refs pickle (convert it to JSON to be sure)")


def load_refs(path: str) -> list[dict]:
    """The refer toolkit's refs: JSON, or its pickle (``refs(unc).p``) through ``_BuiltinsOnly``."""
    if os.path.splitext(path)[1].lower() in (".p", ".pkl", ".pickle"):
        with open(path, "rb") as f:
            try:
                refs = _BuiltinsOnly(f, encoding="latin1").load()
            except DataError as err:
                raise DataError(f"{path}: {err}") from err
            except Exception as err:  # a truncated or foreign pickle
                raise DataError(f"{path}: unreadable refs pickle ({type(err).__name__}: {err})") from err
    else:
        refs = load_records(path)
    if not isinstance(refs, list) or not all(isinstance(r, dict) and "ref_id" in r for r in refs):
        raise DataError(f"{path}: expected a list of refs ({{'ref_id', 'ann_id', 'image_id', 'split', 'sentences'}})")
    return refs


class _Instances:
    """COCO instances.json: image id -> file name, annotation id -> (image id, xywh box)."""

    def __init__(self, path: str):
        data = load_json(path)
        try:
            self.files = {int(im["id"]): str(im["file_name"]) for im in data["images"]}
            self.boxes = {int(a["id"]): (int(a["image_id"]), [float(v) for v in a["bbox"]])
                          for a in data["annotations"]}
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{path}: not a COCO instances file (images, annotations with bbox): {err}") from err

    def box(self, ann_id, where: str) -> tuple[str, list[float]]:
        if int(ann_id) not in self.boxes:
            raise DataError(f"{where}: annotation {ann_id} not in the instances file")
        image_id, box = self.boxes[int(ann_id)]
        return self.files[image_id], box


def _first(record: dict, names: tuple[str, ...], where: str):
    for name in names:
        if name in record:
            return record[name]
    raise DataError(f"{where}: none of the fields {', '.join(names)}")


def _examples_from_refs(refs: list[dict], instances: _Instances, split: str | None, where: str):
    for ref in refs:
        if split is not None and str(ref.get("split")) not in split.split(","):
            continue
        image, box = instances.box(ref["ann_id"], f"{where}: ref {ref['ref_id']}")
        for sentence in ref.get("sentences", []):
            text = sentence.get("sent") or sentence.get("raw") if isinstance(sentence, dict) else sentence
            yield image, str(text), box, str(ref["ref_id"])


def _examples_from_records(records: list, refs: dict | None, instances: _Instances | None, where: str):
    for i, record in enumerate(records):
        at = f"{where}: record {i}"
        if not isinstance(record, dict):
            raise DataError(f"{at}: expected a JSON object")
        text = str(_first(record, ("text", "sentence", "caption"), at))
        ref_id = str(record.get("ref_id", i))
        if "bbox" in record:
            image, box = str(_first(record, ("image", "file_name"), at)), [float(v) for v in record["bbox"]]
        elif refs is not None and instances is not None:
            if ref_id not in refs:
                raise DataError(f"{at}: ref_id {ref_id} not in the refs file")
            image, box = instances.box(refs[ref_id]["ann_id"], at)
            image = str(record.get("image", image))
        else:
            raise DataError(f"{at}: no bbox; records without boxes (ALBEF's grounding files) need --refs and "
                            "--instances to look their ref_id up")
        yield image, text, box, ref_id


def write_grounding(image_root: str, out: str, *, annotations: str | None = None, refs: str | None = None,
                    instances: str | None = None, split: str | None = None, name: str = "grounding",
                    max_side: int | None = None, skip_missing: bool = False, **sizes) -> dict:
    """RefCOCO-family annotations (module docstring) -> grounding shards; -> the manifest entry."""
    ref_list = load_refs(refs) if refs else None
    coco = _Instances(instances) if instances else None
    if annotations:
        by_id = {str(r["ref_id"]): r for r in ref_list} if ref_list is not None else None
        examples = _examples_from_records(load_records(annotations), by_id, coco, annotations)
        source = f"--annotations {annotations}"
    elif ref_list is not None and coco is not None:
        examples = _examples_from_refs(ref_list, coco, split, refs)
        source = f"--refs {refs} --instances {instances}" + (f" --split {split}" if split else "")
    else:
        raise DataError("make-shards grounding: give --annotations (records), or --refs and --instances")
    index = index_images_by_name(image_root)
    description = f"make-shards grounding {source} --images {image_root}"
    missing = 0
    with _writer(out, name, description, **sizes) as writer:
        for i, (image, text, box, ref_id) in enumerate(examples):
            path = os.path.join(image_root, image)
            if not os.path.isfile(path):
                path = index.get(os.path.basename(image), "")
            if not os.path.isfile(path):
                if skip_missing:
                    missing += 1
                    continue
                raise DataError(f"image {image!r} not found under {image_root} (--skip-missing skips it)")
            with Image.open(path) as im:  # the box is in the original file's pixels
                width, height = im.size
            data, ext = read_image_file(path, max_side)
            writer.write({"__key__": f"{i:08d}", ext: data,
                          "json": {"text": text, "bbox": box, "width": width, "height": height, "ref_id": ref_id,
                                   "image": image}})
    if missing:
        print(f"[make-shards] skipped {missing} sample(s) whose image is missing")
    return writer.entry
