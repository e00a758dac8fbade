"""`mplug eval retrieval` under torchrun with 2 CPU processes (gloo): every rank embeds the whole set, each re-ranks
half of the ITC top-k pairs by ITM, and the figures equal those of one process on the same model and shards."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mplug_pretrain.data.writers.shard_writer import shard_pattern
from mplug_pretrain.data.writers.synthetic import write_synthetic_image_shards
from mplug_pretrain.models.presets import build_model
from tests.helpers import REPO_ROOT, call_mplug

CONFIG = os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml")


@pytest.mark.slow  # two torchrun processes (gloo)
def test_two_ranks_give_the_one_process_metrics(tmp_path):
    entry = write_synthetic_image_shards(str(tmp_path / "shards"), num_scenes=30, captions_per_scene=2, layout="image",
                                         seed=4, image_size=32, name="val", max_samples=12)
    shards = shard_pattern(str(tmp_path / "shards"), "val", len(entry["shards"]))
    torch.manual_seed(0)
    build_model("tiny", **{"vision.image_size": 32}).save_pretrained(str(tmp_path / "model"))
    args = ["eval", "retrieval", "--config", CONFIG, "--checkpoint", str(tmp_path / "model"), f"eval.shards={shards}",
            "eval.k_test=7", "eval.num_workers=0", "eval.batch_size=8", "data.train_shards=null"]
    one = call_mplug([*args, "--out", str(tmp_path / "one.json")])
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                          "-m", "mplug_pretrain", *args, "--out", str(tmp_path / "two.json")], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=600, check=False)
    assert two.returncode == 0, two.stderr[-3000:]
    single, split = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert (single["ranks"], split["ranks"]) == (1, 2)
    assert single["num_images"] == split["num_images"] == 30 and split["num_texts"] == 60
    for key in ("ranks", "checkpoint"):
        single.pop(key), split.pop(key)
    assert split == single  # re-ranked and ITC recalls, MedR / MeanR, chance
    assert single["txt_r1"] != single["itc"]["txt_r1"] or single["img_r1"] != single["itc"]["img_r1"] or \
        single["txt_meanr"] != single["itc"]["txt_meanr"]  # the ITM re-ranking changed something
