"""uint8 images normalised on the device (data/device_normalize.py) against the float path (ToTensor + Normalize),
and the torch-resized crop (data/resized_crop.py) against torchvision's PIL RandomResizedCrop."""
import numpy as np
import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim before torchvision)
from mplug_pretrain.data.device_normalize import DeviceNormalize
from mplug_pretrain.data.resized_crop import TorchResizedCrop
from mplug_pretrain.data.transforms import (
    CLIP_MEAN,
    CLIP_STD,
    CaptionSafeRandAugment,
    build_train_transform_uint8,
    seeded_transform,
)
from tests.data.photo_samples import photo


def _torchvision_transforms():
    from torchvision import transforms  # after mplug_pretrain's torchvision shim (imported above)
    return transforms


def test_device_normalize_is_totensor_then_normalize_bit_for_bit():
    T = _torchvision_transforms()
    images = [photo(i, (48, 40)) for i in range(4)]
    float_path = T.Compose([T.ToTensor(), T.Normalize(CLIP_MEAN, CLIP_STD)])
    expected = torch.stack([float_path(im) for im in images])
    uint8 = torch.stack([T.PILToTensor()(im) for im in images])
    assert uint8.dtype == torch.uint8
    got = DeviceNormalize(CLIP_MEAN, CLIP_STD)(uint8)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    # an independent formula: (x / 255 - mean) / std per channel, in float64
    x = uint8.double() / 255
    ref = (x - torch.tensor(CLIP_MEAN, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(
        CLIP_STD, dtype=torch.float64).view(1, 3, 1, 1)
    assert torch.allclose(got.double(), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad", [torch.zeros(2, 3, 8, 8), torch.zeros(3, 8, 8, dtype=torch.uint8),
                                 torch.zeros(2, 1, 8, 8, dtype=torch.uint8)])
def test_device_normalize_refuses_what_is_not_uint8_rgb(bad):
    with pytest.raises(ValueError, match="uint8 images"):
        DeviceNormalize(CLIP_MEAN, CLIP_STD)(bad)


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_torch_resized_crop_draws_torchvisions_boxes_and_nearly_its_pixels(mode):
    T = _torchvision_transforms()
    image = photo(0, (320, 240))
    interpolation = T.InterpolationMode(mode)
    ours = TorchResizedCrop(64, scale=(0.5, 1.0), interpolation=interpolation)
    theirs = T.RandomResizedCrop(64, scale=(0.5, 1.0), interpolation=interpolation)
    diffs = []
    for seed in range(12):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            a = np.asarray(ours(image)).astype(int)
            state_a = torch.random.get_rng_state()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            b = np.asarray(theirs(image)).astype(int)
            state_b = torch.random.get_rng_state()
        assert torch.equal(state_a, state_b)  # the same draws: the same RNG stream afterwards
        diffs.append(np.abs(a - b))
    diffs = np.stack(diffs)
    # the same box and filter: nearly all values equal; a different box would differ almost everywhere
    assert (diffs <= 1).mean() > 0.99 and diffs.mean() < 0.1 and diffs.max() <= 12


def test_randaugment_with_its_space_built_once_augments_as_before():
    image = photo(1, (64, 64))
    cached = CaptionSafeRandAugment(num_ops=2, magnitude=7, num_magnitude_bins=11)
    for seed in range(20):
        fresh = CaptionSafeRandAugment(num_ops=2, magnitude=7, num_magnitude_bins=11)
        a = np.asarray(seeded_transform(cached, image, seed))
        b = np.asarray(seeded_transform(fresh, image, seed))
        assert np.array_equal(a, b), seed


def test_uint8_train_transform_output():
    out = seeded_transform(build_train_transform_uint8(32), photo(2, (80, 60)), 3)
    assert out.dtype == torch.uint8 and out.shape == (3, 32, 32) and int(out.max()) > 0
