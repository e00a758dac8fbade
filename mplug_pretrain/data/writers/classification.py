"""``make-shards snli-ve`` / ``make-shards nlvr2``: classification shards, from the public annotation files or
from synthetic scenes (data/synthetic/statements.py).

Sample layout (kind "classification"; the manifest entry names the ``task`` and its ``labels``):
  snli-ve  <image ext> (one image); json {"sentence", "label", "image_id", "pair_id"}
  nlvr2    left.<ext>, right.<ext> (two images); json {"sentence", "label": "True" | "False", "identifier"}
Annotation files read (records: a JSON list, or JSON Lines when the name ends in .jsonl):
  SNLI-VE  the original jsonl ({"Flickr30K_ID", "sentence2", "gold_label", "pairID"}) or ALBEF's ve_*.json
           ({"image": path, "sentence", "label"}); images under ``image_root`` (Flickr30K: <id>.jpg)
  NLVR2    the original {train,dev,test1}.json lines ({"identifier": "dev-850-0-0", "sentence", "label"}:
           images <split>-<set>-<pair>-img0.png / -img1.png anywhere under ``image_root``) or ALBEF's
           nlvr_*.json ({"images": [left, right], "sentence", "label"})
"""
from __future__ import annotations

import os

import numpy as np

from mplug_pretrain.data.synthetic.scenes import encode_jpeg, render_scene, sample_scene
from mplug_pretrain.data.synthetic.statements import (
    NLVR2_LABELS,
    SNLI_VE_LABELS,
    nlvr2_statement,
    snli_ve_hypothesis,
)
from mplug_pretrain.data.writers.common import index_images_by_name, load_records, read_image_file
from mplug_pretrain.data.writers.shard_writer import ShardWriter, created_by
from mplug_pretrain.errors import DataError

TASK_LABELS = {"snli-ve": SNLI_VE_LABELS, "nlvr2": NLVR2_LABELS}


def _writer(out: str, name: str, task: str, description: str, **sizes) -> ShardWriter:
    return ShardWriter(out, name, kind="classification", created_by=created_by(description),
                       extra={"task": task, "labels": list(TASK_LABELS[task])}, **sizes)


def write_synthetic_snli_ve(out: str, *, num: int, seed: int = 0, image_size: int = 64, name: str = "snli_ve",
                            **sizes) -> dict:
    """``num`` (scene, hypothesis) samples, labels cycling entailment / neutral / contradiction."""
    description = f"make-shards snli-ve --synthetic --num {num} --seed {seed} --image-size {image_size}"
    with _writer(out, name, "snli-ve", description, **sizes) as writer:
        for i in range(num):
            rng = np.random.default_rng([seed, i])
            scene = sample_scene(rng, image_size)
            label = SNLI_VE_LABELS[i % 3]
            writer.write({"__key__": f"{i:08d}", "jpg": encode_jpeg(render_scene(scene, rng)),
                          "json": {"sentence": snli_ve_hypothesis(scene, label, rng), "label": label,
                                   "image_id": i, "pair_id": str(i), "scene": scene.to_json()}})
    return writer.entry


def write_synthetic_nlvr2(out: str, *, num: int, seed: int = 0, image_size: int = 64, name: str = "nlvr2",
                          **sizes) -> dict:
    description = f"make-shards nlvr2 --synthetic --num {num} --seed {seed} --image-size {image_size}"
    with _writer(out, name, "nlvr2", description, **sizes) as writer:
        for i in range(num):
            rng = np.random.default_rng([seed, i])
            left, right = sample_scene(rng, image_size), sample_scene(rng, image_size)
            sentence, truth = nlvr2_statement(left, right, rng)
            writer.write({"__key__": f"{i:08d}", "left.jpg": encode_jpeg(render_scene(left, rng)),
                          "right.jpg": encode_jpeg(render_scene(right, rng)),
                          "json": {"sentence": sentence, "label": str(truth), "identifier": str(i),
                                   "scenes": [left.to_json(), right.to_json()]}})
    return writer.entry


def read_records(path: str) -> list:
    """The annotation records: a JSON list or JSON Lines; a file of one object is one record."""
    records = load_records(path)
    return records if isinstance(records, list) else [records]


def _field(record: dict, names: tuple[str, ...], where: str):
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name in names:
        if name in record:
            return record[name]
    raise DataError(f"{where}: none of the fields {', '.join(names)}")


def _label(value, task: str, where: str) -> str:
    label = str(value)
    if label not in TASK_LABELS[task]:
        raise DataError(f"{where}: label {value!r} not in {TASK_LABELS[task]}")
    return label


def _image(path_or_name: str, image_root: str, index: dict[str, str], where: str, max_side: int | None):
    path = os.path.join(image_root, path_or_name)
    if not os.path.isfile(path):
        path = index.get(os.path.basename(path_or_name), "")
    if not os.path.isfile(path):
        raise DataError(f"{where}: image {path_or_name!r} not found under {image_root}")
    return read_image_file(path, max_side)


def _write_annotated(task: str, annotations: str, image_root: str, out: str, name: str, max_side: int | None,
                     sizes: dict, make_sample) -> dict:
    """One sample per record: ``make_sample(record, where, read_image)`` -> sample fields, or None to skip it;
    ``read_image(name)`` -> (bytes, ext) of an image found under ``image_root``."""
    records = read_records(annotations)
    index = index_images_by_name(image_root)
    description = f"make-shards {task} --annotations {annotations} --image-root {image_root}"
    with _writer(out, name, task, description, **sizes) as writer:
        for i, record in enumerate(records):
            where = f"{annotations}: record {i}"
            sample = make_sample(record, where, lambda image, where=where: _image(image, image_root, index, where,
                                                                                  max_side))
            if sample is not None:
                writer.write({"__key__": f"{i:08d}", **sample})
    return writer.entry


def _snli_ve_sample(record: dict, where: str, read_image) -> dict | None:
    label = _field(record, ("gold_label", "label"), where)
    if label == "-":  # no annotator majority: SNLI-VE leaves these out
        return None
    image = str(_field(record, ("image", "Flickr30K_ID"), where))
    if "." not in os.path.basename(image):
        image += ".jpg"
    data, ext = read_image(image)
    return {ext: data, "json": {"sentence": str(_field(record, ("sentence2", "sentence"), where)),
                                "label": _label(label, "snli-ve", where), "image_id": image,
                                "pair_id": str(record.get("pairID", where.rsplit(" ", 1)[-1]))}}


def write_snli_ve(annotations: str, image_root: str, out: str, *, name: str = "snli_ve",
                  max_side: int | None = None, **sizes) -> dict:
    """SNLI-VE records -> shards; records whose gold label is "-" (no annotator majority) are skipped."""
    return _write_annotated("snli-ve", annotations, image_root, out, name, max_side, sizes, _snli_ve_sample)


def _nlvr2_images(record: dict, where: str) -> list[str]:
    if "images" in record:
        return list(record["images"])
    identifier = str(_field(record, ("identifier",), where))
    stem = identifier.rsplit("-", 1)[0]  # "dev-850-0-0" -> images "dev-850-0-img0.png", "dev-850-0-img1.png"
    return [f"{stem}-img0.png", f"{stem}-img1.png"]


def _nlvr2_sample(record: dict, where: str, read_image) -> dict:
    sample = {}
    for side, image in zip(("left", "right"), _nlvr2_images(record, where)):
        data, ext = read_image(image)
        sample[f"{side}.{ext}"] = data
    sample["json"] = {"sentence": str(_field(record, ("sentence",), where)),
                      "label": _label(_field(record, ("label",), where), "nlvr2", where),
                      "identifier": str(record.get("identifier", where.rsplit(" ", 1)[-1]))}
    return sample


def write_nlvr2(annotations: str, image_root: str, out: str, *, name: str = "nlvr2",
                max_side: int | None = None, **sizes) -> dict:
    return _write_annotated("nlvr2", annotations, image_root, out, name, max_side, sizes, _nlvr2_sample)
