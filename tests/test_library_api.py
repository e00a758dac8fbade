"""The library API (mplug_pretrain.create_model_and_transforms + MPLUG.caption / similarity / answer) on a real
tiny model saved the way training runs and `mplug export` save it, checked against the low-level paths
computed here: beam search over model.memory, ITC features from the encoders, the VQA evaluation predictor."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mplug_pretrain
from mplug_pretrain.data.synthetic.scenes import render_scene, sample_scene
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.models.folder.preprocessing import write_inference_files
from mplug_pretrain.models.generation.decoding import beam_search
from mplug_pretrain.models.generation.settings import AnswerSettings, GenerationSettings
from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.presets import build_model
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's normalisation, written out independently
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_TEXT_LEN = 12


def save_model_folder(path: str, seed: int, generation: GenerationSettings | None = None) -> str:
    """A tiny model folder as training's model/ and `mplug export` write it."""
    torch.manual_seed(seed)
    build_model("tiny").save_pretrained(path)
    write_inference_files(path, tokenizer_path=None, max_text_len=MAX_TEXT_LEN)
    if generation is not None:
        generation.save(path)
    return path


@pytest.fixture(scope="module")
def model_dir(module_mktemp):
    return save_model_folder(str(module_mktemp("api") / "model"), seed=0)


@pytest.fixture(scope="module")
def images():
    """Three synthetic scenes, made non-square so the resize + center crop matters."""
    out = []
    for i in range(3):
        rng = np.random.default_rng([5, i])
        out.append(render_scene(sample_scene(rng, 96), rng).resize((120, 90)))
    return out


def reference_eval_transform(size: int):
    from torchvision import transforms as T  # after mplug_pretrain's torchvision shim
    return T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size), T.ToTensor(),
                      T.Normalize(CLIP_MEAN, CLIP_STD)])


def reference_tokens(tokenizer, texts, max_len=MAX_TEXT_LEN):
    out = tokenizer(texts, padding="longest", truncation=True, max_length=max_len, return_tensors="pt")
    return out["input_ids"], out["attention_mask"]


def decode_until_sep(tokenizer, rows: torch.Tensor) -> list[str]:
    texts = []
    for row in rows.tolist():
        row = row[:row.index(102)] if 102 in row else row
        texts.append(tokenizer.decode([t for t in row if t != 0], skip_special_tokens=True).strip())
    return texts


@pytest.fixture(scope="module")
def loaded(model_dir):
    return mplug_pretrain.create_model_and_transforms(model_dir)


@pytest.fixture(scope="module")
def low_level(model_dir):
    return MPLUG.from_pretrained(model_dir).eval(), load_tokenizer()


def test_import_and_preset_load_no_training_code():
    code = ("import sys, json, mplug_pretrain\n"
            "light = sorted(k for k in sys.modules if k.startswith('mplug_pretrain.'))\n"
            "m, train_t, eval_t, tok = mplug_pretrain.create_model_and_transforms('tiny')\n"
            "print(json.dumps({'light': light, 'all': sorted(sys.modules), 'training': m.training,"
            " 'size': list(eval_t(__import__('PIL.Image').Image.new('RGB', (50, 70))).shape)}))")
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd="/", capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["light"] == ["mplug_pretrain.compat"], "`import mplug_pretrain` must stay light"
    heavy = [m for m in report["all"] if m == "deepspeed" or m.startswith(("deepspeed.", "mplug_pretrain.train",
                                                                           "mplug_pretrain.metrics", "webdataset"))
             or m == "mplug_pretrain.config"]
    assert not heavy, f"inference imported training code: {heavy}"
    assert report["training"] is False and report["size"] == [3, 64, 64]


def test_folder_gives_the_saved_transforms_and_tokenizer(loaded, images):
    model, train_transform, eval_transform, tokenizer = loaded
    assert torch.equal(eval_transform(images[0]), reference_eval_transform(64)(images[0]))
    assert train_transform(images[0]).shape == (3, 64, 64)
    texts = ["a red circle left of a blue square", "what color is the triangle?"]
    assert torch.equal(reference_tokens(tokenizer, texts)[0], reference_tokens(load_tokenizer(), texts)[0])
    assert model.inference_max_text_len == MAX_TEXT_LEN


def test_caption_equals_beam_search_over_memory(loaded, low_level, images):
    model, *_ = loaded
    reference, tokenizer = low_level
    settings = GenerationSettings()
    pixels = torch.stack([reference_eval_transform(64)(im) for im in images])
    ids, mask = reference_tokens(tokenizer, [settings.prompt] * len(images), 64)
    with torch.no_grad():
        memory, memory_mask = reference.memory(pixels, ids, mask)
        out = beam_search(reference.decoder, memory, memory_mask, beam_size=settings.beam_size,
                          max_length=settings.max_length, min_length=settings.min_length,
                          length_penalty=settings.length_penalty)
    expected = decode_until_sep(tokenizer, out.sequences[:, 0])
    assert model.caption(images) == expected
    assert model.caption(pixels) == expected  # already-transformed tensors
    assert [model.caption(im)[0] for im in images] == expected  # one PIL image at a time


def test_caption_uses_the_folders_generation_settings(tmp_path, images):
    settings = GenerationSettings(prompt="an image showing", beam_size=2, max_length=4, min_length=2)
    folder = save_model_folder(str(tmp_path / "caption_model"), seed=1, generation=settings)
    model, *_ = mplug_pretrain.create_model_and_transforms(folder)
    assert model.generation_settings == settings
    explicit = model.caption(images, prompt="an image showing", beam_size=2, max_length=4, min_length=2)
    assert model.caption(images) == explicit
    assert all(len(c.split()) <= 4 for c in explicit)


def test_answer_uses_the_folders_answer_settings(tmp_path, images):
    folder = save_model_folder(str(tmp_path / "vqa_model"), seed=3)
    AnswerSettings(beam_size=2, max_length=3, length_penalty=0.0).save(folder)
    model, *_ = mplug_pretrain.create_model_and_transforms(folder)
    assert model.answer_settings == AnswerSettings(2, 3, 0.0)
    assert model.answer(images, "what is it?") == model.answer(images, "what is it?", beam_size=2, max_length=3)


def test_similarity_equals_itc_from_the_encoders(loaded, low_level, images):
    model, *_ = loaded
    reference, tokenizer = low_level
    texts = ["a red circle", "two blue squares on grass", "a green triangle above a yellow star", "sky"]
    pixels = torch.stack([reference_eval_transform(64)(im) for im in images])
    ids, mask = reference_tokens(tokenizer, texts)
    with torch.no_grad():
        image_feat = F.normalize(reference.itc.vision_proj(reference.image_encoder(pixels)[:, 0]), dim=-1)
        text_feat = F.normalize(reference.itc.text_proj(reference.text_encoder(ids, mask)[:, 0]), dim=-1)
    expected = image_feat @ text_feat.t()
    got = model.similarity(images, texts)
    assert got.shape == (3, 4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_answer_equals_the_vqa_generation_path(loaded, low_level, images):
    from mplug_pretrain.tasks.vqa.evaluate import AnswerPredictor
    model, *_ = loaded
    reference, tokenizer = low_level
    questions = ["what color is the circle?", "how many shapes are there?", "is there a square?"]
    pixels = torch.stack([reference_eval_transform(64)(im) for im in images])
    ids, mask = reference_tokens(tokenizer, questions)
    predictor = AnswerPredictor(reference, tokenizer, "generate", AnswerSettings(beam_size=5, max_length=10,
                                                                                 length_penalty=0.0), rank_k=1)
    expected = predictor(pixels, ids, mask)
    assert model.answer(images, questions) == expected
    same_question = model.answer(images, questions[0])
    assert same_question == predictor(pixels, ids[:1].expand(3, -1), mask[:1].expand(3, -1))


def test_bad_inputs_say_what_is_wrong(loaded, images):
    model, *_ = loaded
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        model.caption(torch.zeros(2, 1, 64, 64))
    with pytest.raises(ValueError, match="3 images but 2 questions"):
        model.answer(images, ["a?", "b?"])
    with pytest.raises(TypeError, match=r"images\[0\]"):
        model.caption(["not an image"])
    with pytest.raises(RuntimeError, match="create_model_and_transforms"):
        build_model("tiny").caption(images)
    with pytest.raises(ValueError, match="neither a preset"):
        mplug_pretrain.create_model_and_transforms("huge")


def _python_blocks(path: str, section: str) -> list[str]:
    with open(os.path.join(REPO_ROOT, path)) as f:
        text = f.read()
    assert section in text, f"{path} has no section {section!r}"
    return re.findall(r"```python\n(.*?)```", text.split(section, 1)[1].split("\n## ", 1)[0], re.DOTALL)


def readme_library_example() -> str:
    """The python example of docs/library.md, "Load a model and run it" (README.md's quick start repeats it)."""
    blocks = _python_blocks("docs/library.md", "## Load a model and run it")
    assert blocks, "docs/library.md's 'Load a model and run it' section has no python example"
    return blocks[0]


def test_the_readme_quick_start_shows_the_library_example_verbatim():
    assert _python_blocks("README.md", "## Quick start") == [readme_library_example()]


def test_readme_example_runs_as_written(tmp_path, images):
    """The library example (docs/library.md and README.md), verbatim, in a folder laid out as `mplug demo` leaves
    runs/demo/."""
    example = readme_library_example()
    for path in re.findall(r'"(runs/demo/[^"]+)"', example):
        save_model_folder(str(tmp_path / path), seed=2)
    for name in re.findall(r'Image\.open\("([^"]+)"\)', example):
        images[0].save(tmp_path / name)
    proc = subprocess.run([sys.executable, "-c", example], check=False, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the example prints its results"
