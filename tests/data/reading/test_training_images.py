"""The pretraining loader's uint8 images (``uint8_images=True``): after the training step's ``DeviceNormalize`` the
model sees the float path's batch. Bit for bit against the same augmentation ending in ToTensor + Normalize;
within the resize kernel's rounding against the reference float loader (PIL's resize)."""
import pytest
import torch

from mplug_pretrain.data.formats.samples import ImageTextFormat
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_loader, build_pretrain_loader
from mplug_pretrain.data.resized_crop import TorchResizedCrop
from mplug_pretrain.data.transforms import (
    CLIP_MEAN,
    CLIP_STD,
    TRAIN_CROP_SCALE,
    CaptionSafeRandAugment,
    interpolation_mode,
)
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from tests.data.photo_samples import photo_jpeg

SIZE = 48


@pytest.fixture(scope="module")
def photo_shards(module_mktemp):
    folder = module_mktemp("photos")
    with ShardWriter(str(folder), "p", kind="image-text", created_by="test", max_samples=6) as writer:
        for i in range(11):  # 160 x 120 photos; two of them large enough for draft mode at 48 px (>= 4 x 48 a side)
            size = (400, 300) if i in (3, 8) else (160, 120)
            writer.write({"__key__": f"k{i:03d}", "jpg": photo_jpeg(i, size), "txt": f"photo number {i}"})
    return str(folder / "p-{000000..000001}.tar")


def _spec(urls):
    return LoaderSpec(urls, 4, num_workers=2, seed=7, shuffle_buffer=4, rank=0, world_size=1)


def _same_augmentation_float(tokenizer, augment_draft_side):
    """The uint8 training transform with ToTensor + Normalize in the worker instead of on the device."""
    from torchvision import transforms as T
    transform = T.Compose([TorchResizedCrop(SIZE, scale=TRAIN_CROP_SCALE, interpolation=interpolation_mode("bicubic")),
                           CaptionSafeRandAugment(num_ops=2, magnitude=7, num_magnitude_bins=11),
                           T.ToTensor(), T.Normalize(CLIP_MEAN, CLIP_STD)])
    return ImageTextFormat(transform, tokenizer, 12, SIZE, draft_side=augment_draft_side)


def test_uint8_batches_normalised_equal_the_float_path_bit_for_bit(photo_shards, tokenizer):
    uint8_loader = build_pretrain_loader(_spec(photo_shards), tokenizer, image_size=SIZE, max_text_len=12,
                                         augment=True, uint8_images=True)
    float_loader = build_loader(_spec(photo_shards), _same_augmentation_float(tokenizer, 2 * SIZE))
    assert uint8_loader.image_normalize is not None and float_loader.image_normalize is None
    pairs = list(zip(uint8_loader, float_loader, strict=True))
    assert len(pairs) == uint8_loader.num_batches
    for ours, theirs in pairs:
        assert ours["image"].dtype == torch.uint8 and ours["image"].shape == (4, 3, SIZE, SIZE)
        assert torch.equal(uint8_loader.image_normalize(ours["image"]), theirs["image"])
        assert ours["__key__"] == theirs["__key__"] and torch.equal(ours["input_ids"], theirs["input_ids"])
        assert torch.equal(ours["is_pad"], theirs["is_pad"])


@pytest.mark.parametrize("augment", [True, False])
def test_uint8_batches_match_the_reference_float_loader_within_rounding(photo_shards, tokenizer, augment):
    """Against ``uint8_images=False`` (PIL resize, no draft mode): with augmentation, the resize kernel and the
    two drafted photos differ by a few levels of 255; without it (the eval transform) the batches are equal."""
    ours = build_pretrain_loader(_spec(photo_shards), tokenizer, image_size=SIZE, max_text_len=12, augment=augment,
                                 uint8_images=True)
    reference = build_pretrain_loader(_spec(photo_shards), tokenizer, image_size=SIZE, max_text_len=12,
                                      augment=augment)
    level = torch.tensor(CLIP_STD).view(1, 3, 1, 1).reciprocal() / 255  # one level of 255 after Normalize
    drafted = []
    for a, b in zip(ours, reference, strict=True):
        assert a["__key__"] == b["__key__"]
        levels = ((ours.image_normalize(a["image"]) - b["image"]).abs() / level)
        if not augment:
            assert levels.max() < 1e-3  # float rounding only: the same pixels
            continue
        undrafted = torch.tensor([k not in ("k003", "k008") for k in a["__key__"]])
        same = levels[undrafted]
        assert (same < 1.5).float().mean() > 0.99 and same.mean() < 0.1
        # drafted photos: the box drawn on the full size (the same view), libjpeg's half-scale decode, the box
        # rounded to its pixels: about 1 level off on average (measured 0.9-1.2); another photo is 65-75 away
        for row in (~undrafted).nonzero().flatten().tolist():
            other = (row + 1) % len(a["__key__"])
            unrelated = ((ours.image_normalize(a["image"])[row] - b["image"][other]).abs() / level[0]).mean()
            drafted.append((float(levels[row].mean()), float(unrelated)))
    if augment:
        assert len(drafted) >= 2  # both drafted photos were seen
        for mean_levels, unrelated in drafted:
            assert mean_levels < 3 and mean_levels < unrelated / 10, drafted
