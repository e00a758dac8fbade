"""Grounding shards (data/writers/grounding.py, tasks/grounding/data.py): synthetic expressions name one object whose
box is found again in the pixels; the RefCOCO layouts (refer refs + COCO instances, records with boxes, ALBEF records
with ref_id) are read; a refs pickle is read as builtin data only and a pickle naming any class is refused."""
from __future__ import annotations

import io
import json
import pickle
import re

import numpy as np
import pytest
import torch
from PIL import Image

from mplug_pretrain.data.formats.image_decode import SampleError
from mplug_pretrain.data.synthetic.scenes import COLORS, POSITION_PHRASES
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.data.writers.grounding import load_refs, write_grounding, write_synthetic_grounding
from mplug_pretrain.errors import DataError
from mplug_pretrain.tasks.grounding.data import GroundingFormat
from tests.data.shard_samples import read_samples


def _referred(text: str, objects: list[dict]) -> list[dict]:
    """The scene objects an expression fits, by hand-written rules (independent of the generator)."""
    phrases = {v: k for k, v in POSITION_PHRASES.items()}
    fits = []
    for o in objects:
        where = POSITION_PHRASES[o["position"]]
        if m := re.fullmatch(r"the shape (.+)", text):
            ok = phrases.get(m.group(1)) == o["position"]
        elif m := re.fullmatch(r"the (\w+) shape", text):
            ok = m.group(1) == o["color"]
        else:
            ok = text in (f"the {o['color']} {o['shape']}", f"the {o['shape']}",
                          f"the {o['size']} {o['color']} {o['shape']} {where}")
        fits += [o] if ok else []
    return fits


def test_synthetic_expressions_name_exactly_one_object_whose_box_holds_its_colour(tmp_path):
    write_synthetic_grounding(str(tmp_path), num=60, seed=3, image_size=64, name="g")
    samples = read_samples(tmp_path / "g-000000.tar")
    assert len(samples) == 60
    for sample in samples:
        meta = json.loads(sample["json"])
        fits = _referred(meta["text"], meta["scene"]["objects"])
        assert len(fits) == 1, meta
        (cx, cy), r = fits[0]["center"], fits[0]["radius"]
        assert meta["bbox"] == pytest.approx([cx - r, cy - r, 2 * r, 2 * r]) and meta["width"] == 64
        pixels = np.asarray(Image.open(io.BytesIO(sample["jpg"])), dtype=np.float32)
        colour = np.array(COLORS[fits[0]["color"]], dtype=np.float32)
        assert np.abs(pixels[int(cy), int(cx)] - colour).max() < 60  # the box centre shows the object's colour


def _coco(tmp_path, sizes=((40, 30), (50, 20))):
    images = tmp_path / "train2014"
    images.mkdir()
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (i * 100, 0, 0)).save(images / f"COCO_train2014_{i:012d}.jpg")
    instances = {"images": [{"id": i, "file_name": f"COCO_train2014_{i:012d}.jpg", "width": w, "height": h}
                            for i, (w, h) in enumerate(sizes)],
                 "annotations": [{"id": 10, "image_id": 0, "bbox": [4, 3, 20, 10], "category_id": 1},
                                 {"id": 11, "image_id": 1, "bbox": [10, 5, 30, 10], "category_id": 1}]}
    (tmp_path / "instances.json").write_text(json.dumps(instances))
    refs = [{"ref_id": 0, "ann_id": 10, "image_id": 0, "split": "train", "file_name": "COCO_train2014_0_10.jpg",
             "sentences": [{"sent": "the left man", "raw": "The left man"}, {"sent": "man on left"}]},
            {"ref_id": 1, "ann_id": 11, "image_id": 1, "split": "val", "sentences": [{"sent": "red car"}]}]
    return images, refs


def _meta(out, name):
    return [json.loads(s["json"]) for s in read_samples(out / f"{name}-000000.tar")]


def test_refer_refs_and_instances_give_one_sample_per_sentence_of_the_split(tmp_path):
    images, refs = _coco(tmp_path)
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    out = tmp_path / "shards"
    entry = write_grounding(str(tmp_path), str(out), refs=str(tmp_path / "refs.json"),
                            instances=str(tmp_path / "instances.json"), split="train", name="train")
    assert entry["total"] == 2
    metas = _meta(out, "train")
    assert [m["text"] for m in metas] == ["the left man", "man on left"]
    assert metas[0]["bbox"] == [4, 3, 20, 10] and (metas[0]["width"], metas[0]["height"]) == (40, 30)
    write_grounding(str(images), str(out), refs=str(tmp_path / "refs.json"), instances=str(tmp_path / "instances.json"),
                    split="val", name="val")
    assert [(m["text"], m["bbox"], m["width"], m["ref_id"]) for m in _meta(out, "val")] == \
        [("red car", [10, 5, 30, 10], 50, "1")]


def test_refs_pickle_is_read_as_builtin_data_and_a_class_reference_is_refused(tmp_path):
    _, refs = _coco(tmp_path)
    (tmp_path / "refs(unc).p").write_bytes(pickle.dumps(refs, protocol=2))
    assert load_refs(str(tmp_path / "refs(unc).p")) == refs

    class Evil:
        def __reduce__(self):
            return (print, ("unpickled code ran",))
    (tmp_path / "evil.p").write_bytes(pickle.dumps([{"ref_id": 0, "x": Evil()}]))
    with pytest.raises(DataError, match="refuses to unpickle builtins.print"):
        load_refs(str(tmp_path / "evil.p"))
    (tmp_path / "set.p").write_bytes(pickle.dumps([{"ref_id": 0, "x": np.float32(1)}]))
    with pytest.raises(DataError, match="refuses to unpickle numpy"):
        load_refs(str(tmp_path / "set.p"))


def test_records_with_boxes_and_albef_records_with_ref_ids(tmp_path):
    _, refs = _coco(tmp_path)
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    records = [{"image": "train2014/COCO_train2014_000000000001.jpg", "text": "the car", "bbox": [1, 2, 3, 4]}]
    (tmp_path / "flat.json").write_text(json.dumps(records))
    out = tmp_path / "shards"
    write_grounding(str(tmp_path), str(out), annotations=str(tmp_path / "flat.json"), name="flat")
    assert [(m["text"], m["bbox"], m["width"], m["height"]) for m in _meta(out, "flat")] == \
        [("the car", [1, 2, 3, 4], 50, 20)]
    albef = [{"image": "train2014/COCO_train2014_000000000000.jpg", "text": "left man", "ref_id": 0}]
    (tmp_path / "albef.json").write_text(json.dumps(albef))
    with pytest.raises(DataError, match="need --refs and --instances"):
        write_grounding(str(tmp_path), str(out), annotations=str(tmp_path / "albef.json"), name="albef")
    write_grounding(str(tmp_path), str(out), annotations=str(tmp_path / "albef.json"), refs=str(tmp_path / "refs.json"),
                    instances=str(tmp_path / "instances.json"), name="albef", overwrite=True)
    assert [(m["text"], m["bbox"]) for m in _meta(out, "albef")] == [("left man", [4, 3, 20, 10])]
    records[0]["image"] = "missing.jpg"
    (tmp_path / "flat.json").write_text(json.dumps(records))
    with pytest.raises(DataError, match="'missing.jpg' not found"):
        write_grounding(str(tmp_path), str(out), annotations=str(tmp_path / "flat.json"), name="gone")


def test_format_normalises_the_box_by_the_stored_image_size_and_rejects_bad_boxes():
    fmt = GroundingFormat(load_tokenizer(), 20, 32)
    buf = io.BytesIO()
    Image.new("RGB", (40, 20)).save(buf, format="PNG")
    sample = {"__key__": "k", "__pos__": 0, "png": buf.getvalue(),
              "json": json.dumps({"text": "a car", "bbox": [4, 5, 20, 10], "width": 40, "height": 20}).encode()}
    decoded = fmt.decode(sample, 0)
    assert decoded["images"].shape == (3, 32, 32)
    torch.testing.assert_close(decoded["boxes"], torch.tensor([0.1, 0.25, 0.5, 0.5]))
    batch = fmt.collate([decoded, fmt.blank()], [False, True])
    assert batch["boxes"].shape == (2, 4) and batch["is_pad"].tolist() == [False, True]
    for bad in ([4, 5, 0, 10], [50, 5, 2, 2], "nope"):
        sample["json"] = json.dumps({"text": "a car", "bbox": bad, "width": 40, "height": 20}).encode()
        with pytest.raises(SampleError) as err:
            fmt.decode(sample, 0)
        assert err.value.kind == "bad_box"
