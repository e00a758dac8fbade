"""SNLI-VE / NLVR2 shards: synthetic statements are true of their scenes (checked by an independent reading of the
scene JSON), the public annotation layouts are read, bad records are named, and the batch format holds."""
from __future__ import annotations

import io
import json
import re

import pytest
import torch
from PIL import Image

from mplug_pretrain.data.formats.image_decode import SampleError
from mplug_pretrain.data.synthetic.scenes import POSITION_PHRASES
from mplug_pretrain.data.writers.classification import (
    write_nlvr2,
    write_snli_ve,
    write_synthetic_nlvr2,
    write_synthetic_snli_ve,
)
from mplug_pretrain.errors import DataError
from mplug_pretrain.tasks.classify.data import TASKS, ClassificationFormat
from tests.data.shard_samples import read_samples


def snli_ve_truth(sentence: str, objects: list[dict]) -> str:
    """The label of a hypothesis, read from the scene's objects by hand-written rules."""
    by_shape = {o["shape"]: o for o in objects}
    phrases = {v: k for k, v in POSITION_PHRASES.items()}
    if m := re.fullmatch(r"the (\w+) (\w+) is (made of \w+|heavy|brand new|very old|expensive)", sentence):
        return "neutral"
    if m := re.fullmatch(r"the (\w+) is (\w+)", sentence):
        return "entailment" if by_shape[m[1]]["color"] == m[2] else "contradiction"
    if m := re.fullmatch(r"the (\w+) (\w+) is (.+)", sentence):
        return "entailment" if by_shape[m[2]]["position"] == phrases[m[3]] else "contradiction"
    if m := re.fullmatch(r"there is a (\w+) (\w+)", sentence):
        return "entailment" if by_shape.get(m[2], {}).get("color") == m[1] else "contradiction"
    if m := re.fullmatch(r"there is a (\w+)", sentence):
        return "entailment" if m[1] in by_shape else "contradiction"
    raise AssertionError(f"unexpected hypothesis {sentence!r}")


def nlvr2_truth(sentence: str, scenes: list[dict]) -> bool:
    m = re.fullmatch(r"(the left image has|the right image has|both images have|exactly one image has) a (\w+)( shape)?",
                     sentence)
    assert m, sentence
    has = [any((o["color"] if m[3] else o["shape"]) == m[2] for o in s["objects"]) for s in scenes]
    return {"the left image has": has[0], "the right image has": has[1], "both images have": all(has),
            "exactly one image has": has[0] != has[1]}[m[1]]


def test_synthetic_snli_ve_labels_are_true_of_their_scenes(tmp_path):
    write_synthetic_snli_ve(str(tmp_path), num=90)
    samples = read_samples(tmp_path / "snli_ve-000000.tar")
    labels = [json.loads(s["json"])["label"] for s in samples]
    assert {labels.count(k) for k in ("entailment", "neutral", "contradiction")} == {30}
    for sample in samples:
        meta = json.loads(sample["json"])
        assert snli_ve_truth(meta["sentence"], meta["scene"]["objects"]) == meta["label"], meta["sentence"]


def test_synthetic_nlvr2_labels_are_true_and_balanced(tmp_path):
    write_synthetic_nlvr2(str(tmp_path), num=200)
    samples = read_samples(tmp_path / "nlvr2-000000.tar")
    truths = []
    for sample in samples:
        meta = json.loads(sample["json"])
        assert str(nlvr2_truth(meta["sentence"], meta["scenes"])) == meta["label"], meta["sentence"]
        assert {"left.jpg", "right.jpg"} <= set(sample)
        truths.append(meta["label"] == "True")
    assert 0.35 < sum(truths) / len(truths) < 0.65


def _png(path, color):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), color).save(path)


def test_snli_ve_original_and_albef_layouts(tmp_path):
    _png(tmp_path / "images" / "100.jpg", "red")
    _png(tmp_path / "images" / "200.jpg", "blue")
    original = tmp_path / "snli_ve_dev.jsonl"
    original.write_text("\n".join(json.dumps(r) for r in [
        {"Flickr30K_ID": "100", "sentence2": "A red thing.", "gold_label": "entailment", "pairID": "p1"},
        {"Flickr30K_ID": "200", "sentence2": "No agreement.", "gold_label": "-", "pairID": "p2"},
        {"Flickr30K_ID": "200", "sentence2": "A red thing.", "gold_label": "contradiction", "pairID": "p3"}]))
    entry = write_snli_ve(str(original), str(tmp_path / "images"), str(tmp_path / "a"))
    assert entry["total"] == 2 and entry["labels"] == ["entailment", "neutral", "contradiction"]
    metas = [json.loads(s["json"]) for s in read_samples(tmp_path / "a" / "snli_ve-000000.tar")]
    assert [(m["label"], m["pair_id"]) for m in metas] == [("entailment", "p1"), ("contradiction", "p3")]
    albef = tmp_path / "ve_dev.json"
    albef.write_text(json.dumps([{"image": "200.jpg", "sentence": "A blue thing.", "label": "neutral"}]))
    assert write_snli_ve(str(albef), str(tmp_path / "images"), str(tmp_path / "b"))["total"] == 1
    albef.write_text(json.dumps([{"image": "300.jpg", "sentence": "x", "label": "neutral"}]))
    with pytest.raises(DataError, match=r"record 0: image '300.jpg' not found"):
        write_snli_ve(str(albef), str(tmp_path / "images"), str(tmp_path / "c"))
    albef.write_text(json.dumps([{"image": "200.jpg", "sentence": "x", "label": "maybe"}]))
    with pytest.raises(DataError, match=r"record 0: label 'maybe' not in"):
        write_snli_ve(str(albef), str(tmp_path / "images"), str(tmp_path / "d"))


def test_nlvr2_identifier_and_albef_layouts(tmp_path):
    for side, color in (("img0", "red"), ("img1", "green")):
        _png(tmp_path / "images" / "dev" / "7" / f"dev-850-0-{side}.png", color)  # the release's numbered folders
    original = tmp_path / "dev.json"
    original.write_text(json.dumps({"identifier": "dev-850-0-1", "sentence": "One is red.", "label": "True"}) + "\n")
    write_nlvr2(str(original), str(tmp_path / "images"), str(tmp_path / "a"))
    (sample,) = read_samples(tmp_path / "a" / "nlvr2-000000.tar")
    assert Image.open(io.BytesIO(sample["left.png"])).getpixel((0, 0)) == (255, 0, 0)
    assert Image.open(io.BytesIO(sample["right.png"])).getpixel((0, 0)) == (0, 128, 0)
    albef = tmp_path / "nlvr_dev.json"
    albef.write_text(json.dumps([{"images": ["dev/7/dev-850-0-img1.png", "dev/7/dev-850-0-img0.png"],
                                  "sentence": "Swapped.", "label": "False"}]))
    write_nlvr2(str(albef), str(tmp_path / "images"), str(tmp_path / "b"))
    (sample,) = read_samples(tmp_path / "b" / "nlvr2-000000.tar")
    assert Image.open(io.BytesIO(sample["left.png"])).getpixel((0, 0)) == (0, 128, 0)


def test_pair_format_stacks_both_images_and_refuses_a_bad_label(tmp_path):
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.data.transforms import build_eval_transform
    write_synthetic_nlvr2(str(tmp_path), num=3, image_size=32)
    samples = read_samples(tmp_path / "nlvr2-000000.tar")
    task = TASKS["nlvr2"]
    fmt = ClassificationFormat(build_eval_transform(32), load_tokenizer(None), 16, 32, task.labels, task.images)
    decoded = [fmt.decode({**s, "__key__": f"k{i}", "__pos__": i}, seed=0) for i, s in enumerate(samples)]
    batch = fmt.collate(decoded + [fmt.blank()], [False] * 3 + [True])
    assert batch["images"].shape == (4, 2, 3, 32, 32)
    assert not torch.equal(batch["images"][0, 0], batch["images"][0, 1])
    assert batch["label"].tolist()[:3] == [task.labels.index(json.loads(s["json"])["label"]) for s in samples]
    assert batch["label"][3] == -1 and batch["is_pad"].tolist() == [False, False, False, True]
    bad = {**samples[0], "json": json.dumps({"sentence": "x", "label": "Maybe"}).encode(), "__key__": "b", "__pos__": 0}
    with pytest.raises(SampleError) as err:
        fmt.decode(bad, seed=0)
    assert err.value.kind == "bad_label"
