"""`mplug eval caption` (tasks/caption/evaluate.py) against pycocoevalcap called directly on the files it wrote,
and `mplug caption --checkpoint DIR IMAGE...` (tasks/caption/predict.py) through the real CLI."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.config import load_config
from mplug_pretrain.data.synthetic.scenes import encode_jpeg, render_scene, sample_scene
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.data.transforms import build_eval_transform
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from mplug_pretrain.tasks.caption import evaluate as caption_task
from mplug_pretrain.tasks.caption.evaluate import GenerationSettings, caption_images
from mplug_pretrain.tasks.caption.predict import image_files
from tests.helpers import call_mplug

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = GenerationSettings(prompt="a picture of", beam_size=3, max_length=8, min_length=3)


@pytest.fixture(scope="module")
def images():
    rendered = []
    for i in range(5):
        rng = np.random.default_rng([11, i])
        rendered.append(render_scene(sample_scene(rng, 64), rng))
    return rendered


@pytest.fixture(scope="module")
def eval_case(module_mktemp, model_dir, images):
    """Image-layout shards whose references partly overlap what the model will say, so that every metric is
    non-trivial: per image, the prediction with one word changed, a reordered copy, an unrelated caption."""
    from mplug_pretrain.models.mplug import MPLUG
    model = MPLUG.from_pretrained(model_dir).eval()
    transform = build_eval_transform(64)
    predictions = caption_images(model, torch.stack([transform(im) for im in images]), load_tokenizer(), SETTINGS)
    folder = module_mktemp("eval_shards")
    references = {}
    with ShardWriter(str(folder), "test", kind="image-text", created_by="test", max_samples=100) as writer:
        for i, (image, caption) in enumerate(zip(images, predictions)):
            words = caption.split() or ["empty"]
            refs = [" ".join(words[:-1] + ["circle"]), " ".join(reversed(words)) + ".",
                    "A small red square on the left."]
            references[100 + i] = refs
            writer.write({"__key__": f"{i:05d}", "jpg": encode_jpeg(image), "txt": refs[0],
                          "json": {"image_id": 100 + i, "captions": refs}})
    return str(folder / "test-000000.tar"), references


def test_caption_metrics_task_equals_pycocoevalcap_called_directly(eval_case, model_dir, tmp_path):
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
    shards, references = eval_case
    cfg = load_config(None, [f"eval.shards={shards}", "eval.num_workers=0", "eval.batch_size=2",
                             f"caption.generation.beam_size={SETTINGS.beam_size}",
                             f"caption.generation.max_length={SETTINGS.max_length}",
                             f"caption.generation.min_length={SETTINGS.min_length}"])
    out = str(tmp_path / "metrics.json")
    metrics = caption_task.run(cfg, checkpoint=model_dir, out=out)

    with open(tmp_path / "metrics.caption_predictions.json") as f:
        results = json.load(f)
    assert sorted(r["image_id"] for r in results) == sorted(references)  # COCO results format, every image
    predictions = {r["image_id"]: r["caption"] for r in results}
    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": c} for c in refs] for i, refs in references.items()})
    res = tokenizer.tokenize({i: [{"caption": predictions[i]}] for i in references})
    direct = dict(zip(["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4"], Bleu(4).compute_score(gts, res)[0]))
    direct["METEOR"] = Meteor().compute_score(gts, res)[0]
    direct["ROUGE_L"] = Rouge().compute_score(gts, res)[0]
    direct["CIDEr"] = Cider().compute_score(gts, res)[0]
    for name, value in direct.items():
        assert metrics[name] == pytest.approx(value, abs=1e-12), name
    assert 0.3 < direct["Bleu_1"] < 1.0 and direct["CIDEr"] > 0.1  # a non-degenerate case
    with open(out) as f:
        written = json.load(f)
    assert {k: written[k] for k in direct} == {k: metrics[k] for k in direct}
    assert written["num_images"] == 5 and written["spice"].startswith(("computed", "skipped"))


def test_mplug_caption_cli_prints_one_caption_per_image(model_dir, images, tmp_path):
    paths = []
    for i, image in enumerate(images[:2]):
        path = tmp_path / f"img{i}.png"
        image.save(path)
        paths.append(str(path))
    gray = tmp_path / "COCO_val2014_000000000042.png"
    Image.fromarray(np.zeros((40, 30), np.uint8), "L").save(gray)  # grey, not square
    out = tmp_path / "results.json"
    proc = call_mplug(["caption", "--checkpoint", model_dir, paths[0], str(tmp_path), "--beam-size", "3",
                       "--max-length", "8", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split("\t") for line in proc.stdout.strip().splitlines()]
    assert [p for p, _ in lines] == [paths[0], str(gray), *paths]  # the file, then the folder's files
    assert all(caption.strip() for _, caption in lines)
    from mplug_pretrain.models.mplug import MPLUG
    model = MPLUG.from_pretrained(model_dir).eval()
    expected = caption_images(model, build_eval_transform(64)(images[0].convert("RGB"))[None], load_tokenizer(),
                              GenerationSettings(beam_size=3, max_length=8))
    assert lines[0][1] == expected[0]
    with open(out) as f:
        assert {r["image_id"] for r in json.load(f)} == {42, "img0", "img1"}
    with pytest.raises(FileNotFoundError, match="missing.png"):
        image_files([str(tmp_path / "missing.png")])


def test_generation_settings_saved_with_a_model_are_used(model_dir, tmp_path):
    GenerationSettings(prompt="a photo of", beam_size=2).save(str(tmp_path))
    assert GenerationSettings.from_model_dir(str(tmp_path)) == GenerationSettings(prompt="a photo of", beam_size=2)
    assert GenerationSettings.from_model_dir(model_dir) == GenerationSettings()
    assert os.path.basename(caption_task.GENERATION_FILE) == "caption_generation.json"
