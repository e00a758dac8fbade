"""The two retrieval stages of ``mplug demo`` on small synthetic sets: their R@1 is the mean of the two
directions, reported beside the exact chance level of that many items."""
import os

import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.data.writers.synthetic import write_synthetic_image_shards, write_synthetic_video_shards
from mplug_pretrain.demo.retrieval_stage import retrieval_demo, video_retrieval_demo
from mplug_pretrain.models.presets import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(module_mktemp):
    root = module_mktemp("demo")
    torch.manual_seed(0)
    build_model("tiny").save_pretrained(str(root / "model"))
    write_synthetic_image_shards(str(root / "images"), name="val", num_scenes=8, captions_per_scene=3,
                                 layout="image", seed=5)
    write_synthetic_video_shards(str(root / "videos"), name="val", num_videos=6, seed=6, num_frames=8)
    shards = {"pretrain_val": os.path.join(root, "images", "val-000000.tar"),
              "video": os.path.join(root, "videos", "val-000000.tar")}
    return str(root / "model"), shards


def test_retrieval_demo(setup):
    model_dir, shards = setup
    out = retrieval_demo(model_dir, shards, os.path.dirname(model_dir))
    # chance with 8 images x 3 captions: image -> text 3/24, text -> image 1/8
    assert out["retrieval_chance"] == pytest.approx(100 * (3 / 24 + 1 / 8) / 2)
    assert out["retrieval_r1"] == pytest.approx((out["retrieval_txt_r1"] + out["retrieval_img_r1"]) / 2)
    assert 0 <= out["retrieval_r1"] <= 100 and out["retrieval_k_test"] == 10


def test_video_retrieval_demo(setup):
    model_dir, shards = setup
    out = video_retrieval_demo(model_dir, shards, os.path.dirname(model_dir))
    assert out["video_retrieval_chance"] == pytest.approx(100 * (3 / 18 + 1 / 6) / 2)  # 6 videos x 3 captions
    directions = (out["video_retrieval_txt_r1"], out["video_retrieval_vid_r1"])
    assert out["video_retrieval_r1"] == pytest.approx(sum(directions) / 2)
    assert out["videos_skipped"] == 0 and out["video_retrieval_num_frames"] == 8
