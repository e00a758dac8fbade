"""Captions predicted on img2dataset shards are keyed by img2dataset's own ``key`` (issue 36, item 8), which a
user can look up in the parquet / json beside the tar; they were keyed by a 64-bit hash."""
import json

import pytest

from tests.data.formats.test_manifest_img2dataset import write_img2dataset_folder
from tests.helpers import REPO_ROOT, call_mplug

pytestmark = pytest.mark.usefixtures("one_thread")


def test_eval_caption_predictions_carry_the_img2dataset_key(tmp_path, model_dir):
    folder = str(tmp_path / "laion_subset")
    captions = write_img2dataset_folder(folder, [3])
    out = tmp_path / "m.json"
    proc = call_mplug(["eval", "caption", "--config", f"{REPO_ROOT}/configs/caption_demo.yaml", "--checkpoint",
                       model_dir, f"caption.val_shards={folder}", "--out", out, "eval.caption_metrics=cider",
                       "eval.num_workers=0", "eval.batch_size=3", "caption.generation.beam_size=2",
                       "caption.generation.max_length=5", "caption.generation.min_length=2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(json.loads(out.read_text())["predictions"]) as f:
        ids = sorted(r["image_id"] for r in json.load(f))
    assert ids == sorted(int(key) for key in captions)
