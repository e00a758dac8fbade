"""Feature cache (tasks/caption/feature_cache.py): cached ViT features give the same caption loss as running the frozen
encoder, one row per image, the fingerprint follows the ViT weights, uncached images are skipped and counted."""
import os

import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_loader
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.data.transforms import build_eval_transform
from mplug_pretrain.data.writers.synthetic import write_synthetic_image_shards
from mplug_pretrain.models.towers.vision import states_from_vit_tokens
from mplug_pretrain.tasks.caption.cached_features import FeatureCache, build_cached_loader
from mplug_pretrain.tasks.caption.data import CaptionImageFormat, CaptionText, prompt_ids
from mplug_pretrain.tasks.caption.feature_cache import build_feature_cache
from mplug_pretrain.tasks.caption.losses import visual_states
from mplug_pretrain.tasks.caption.model import captioner

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE = 64


@pytest.fixture(scope="module")
def shards(module_mktemp):
    root = module_mktemp("cache_shards")
    out = {}
    for name, seed in (("a", 5), ("b", 6)):
        entry = write_synthetic_image_shards(str(root / name), num_scenes=6, captions_per_scene=2, layout="pair",
                                             seed=seed, image_size=SIZE, name=name)
        out[name] = str(root / name / entry["shards"][0]["file"])
    return out


@pytest.fixture(scope="module")
def model():
    from mplug_pretrain.models.presets import get_preset_config
    torch.manual_seed(0)
    return captioner(get_preset_config("tiny")).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _batches(loader):
    return next(iter(loader))


def in_order(urls: str, batch_size: int) -> LoaderSpec:
    return LoaderSpec.evaluation(urls, batch_size, rank=0, world_size=1)


def test_cached_features_give_the_loss_of_the_frozen_encoder(shards, model, tokenizer, tmp_path):
    text_fn = CaptionText("a picture of")
    folder = build_feature_cache(model, shards["a"], str(tmp_path), SIZE, log=lambda line: None)
    cached = _batches(build_cached_loader(in_order(shards["a"], 12), FeatureCache(folder), tokenizer, text_fn, 30))
    fmt = CaptionImageFormat(build_eval_transform(SIZE), tokenizer, 30, SIZE, text_fn)
    images = _batches(build_loader(in_order(shards["a"], 12), fmt))
    assert cached["__key__"] == images["__key__"] and len(set(cached["__key__"])) == 12
    assert torch.equal(cached["input_ids"], images["input_ids"])
    prompt_length = prompt_ids(tokenizer, "a picture of").shape[1] - 1
    with torch.no_grad():
        reference = model.caption_loss(images["image"], images["input_ids"], images["attention_mask"], prompt_length)
        from_cache = model.caption_loss_from_states(states_from_vit_tokens(model.image_encoder, cached["features"]),
                                                    cached["input_ids"], cached["attention_mask"], prompt_length)
    assert abs(from_cache.item() - reference.item()) <= 1e-6
    assert reference.item() > 1.0  # a real loss, not a degenerate zero


def test_one_row_per_image_equal_to_the_vit_output_and_fingerprint_follows_weights(shards, model, tmp_path):
    folder = build_feature_cache(model, shards["a"], str(tmp_path), SIZE, log=lambda line: None)
    cache = FeatureCache(folder)
    assert len(cache) == 6  # 12 caption samples, 6 images
    fmt = CaptionImageFormat(build_eval_transform(SIZE), load_tokenizer(), 30, SIZE, CaptionText(""))
    fmt_images = _batches(build_loader(in_order(shards["a"], 12), fmt))
    with torch.no_grad():
        tokens = model.image_encoder.vit(fmt_images["image"])
    keys = [f"{os.path.abspath(shards['a'])}#{image_id}" for image_id in fmt_images["image_id"].tolist()]
    for row, key in enumerate(keys):
        torch.testing.assert_close(torch.from_numpy(cache.get(key)), tokens[row], rtol=0, atol=1e-6)
    stamp = os.path.getmtime(os.path.join(folder, "meta.json"))
    assert build_feature_cache(model, shards["a"], str(tmp_path), SIZE, log=lambda line: None) == folder
    assert os.path.getmtime(os.path.join(folder, "meta.json")) == stamp  # reused, not rebuilt
    changed = captioner(model.config)
    with torch.no_grad():
        changed.load_state_dict(model.state_dict())
        changed.image_encoder.vit.ln_post.bias.add_(0.01)
    assert build_feature_cache(changed, shards["a"], str(tmp_path), SIZE, log=lambda line: None) != folder
    half = FeatureCache(build_feature_cache(model, shards["a"], str(tmp_path), SIZE, dtype="float16",
                                            log=lambda line: None))
    torch.testing.assert_close(torch.from_numpy(half.get(keys[0])), tokens[0], rtol=1e-3, atol=1e-2)


def test_images_missing_from_the_cache_are_skipped_and_counted(shards, model, tokenizer, tmp_path):
    """Data set b numbers its images 0..5 like a: keys carry the shard, so b finds no features."""
    cache = FeatureCache(build_feature_cache(model, shards["a"], str(tmp_path), SIZE, log=lambda line: None))
    loader = build_cached_loader(in_order(shards["b"], 4), cache, tokenizer, CaptionText("a picture of"), 30)
    batches = list(loader)
    assert loader.stats.counts["missing_features"] == 12
    assert all(bool(b["is_pad"].all()) for b in batches)


def test_frozen_vision_takes_no_gradient(shards, model, tokenizer):
    fmt = CaptionImageFormat(build_eval_transform(SIZE), tokenizer, 30, SIZE, CaptionText("a picture of"))
    batch = _batches(build_loader(in_order(shards["a"], 4), fmt))
    trained = captioner(model.config)
    states = visual_states(trained, batch, [0, 1, 2, 3], freeze_vision=True)
    trained.caption_loss_from_states(states, batch["input_ids"], batch["attention_mask"], 4).backward()
    assert all(p.grad is None for p in trained.image_encoder.vit.parameters())
    assert trained.decoder.embeddings.word_embeddings.weight.grad is not None
