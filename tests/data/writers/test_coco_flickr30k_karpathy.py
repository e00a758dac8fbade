"""`make-shards coco` reads Karpathy's dataset_flickr30k.json too (no filepath, ids in imgid): the pair layout for
retrieval fine-tuning gives one sample per caption with its image's id, the chosen splits only."""
from __future__ import annotations

import json

from PIL import Image

from mplug_pretrain.data.writers.coco import write_coco_shards
from tests.data.shard_samples import read_samples


def test_flickr30k_karpathy_json_in_the_pair_layout(tmp_path):
    images = tmp_path / "flickr30k-images"
    images.mkdir()
    entries = []
    for imgid, (name, split) in enumerate([("1000092795.jpg", "train"), ("10002456.jpg", "test"),
                                           ("1000268201.jpg", "train")]):
        Image.new("RGB", (20, 16), (imgid * 80, 10, 10)).save(images / name)
        entries.append({"filename": name, "imgid": imgid, "split": split, "sentids": [2 * imgid, 2 * imgid + 1],
                        "sentences": [{"raw": f"Picture {imgid} caption {j}.", "imgid": imgid} for j in range(2)]})
    (tmp_path / "dataset_flickr30k.json").write_text(json.dumps({"images": entries, "dataset": "flickr30k"}))
    entry = write_coco_shards(str(tmp_path / "dataset_flickr30k.json"), str(images), str(tmp_path / "out"),
                              split="train", layout="pair", name="train")
    assert entry["total"] == 4
    samples = read_samples(tmp_path / "out" / "train-000000.tar")
    assert sorted((json.loads(s["json"])["image_id"], s["txt"].decode()) for s in samples) == \
        [(0, "Picture 0 caption 0."), (0, "Picture 0 caption 1."), (2, "Picture 2 caption 0."),
         (2, "Picture 2 caption 1.")]
