"""Image transforms (PIL RGB -> float32 [3, H, W]); standalone, for inference users too.

train: RandomResizedCrop(size, scale=(0.5, 1.0), bicubic) -> RandAugment(2 ops, magnitude 7/10)
       -> ToTensor -> Normalize(CLIP mean/std). The RandAugment op set is ALBEF/mPLUG's
       ``RandomAugment(2, 7, augs=[Identity, AutoContrast, Equalize, Brightness, Sharpness,
       ShearX, ShearY, TranslateX, TranslateY, Rotate])``: no flips and no colour-destroying ops
       (Solarize, Posterize, Color), so "red", "left", "top" in a caption stay true.
eval:  Resize(size, bicubic) of the shorter side -> CenterCrop(size) -> ToTensor -> Normalize.
train, uint8 (the training loaders): RandomResizedCrop resized by torch's uint8 kernel (data/resized_crop.py)
       -> RandAugment -> uint8 [3, H, W]; the training step normalises on its device (data/device_normalize.py).
"""
from __future__ import annotations

import torch
from torchvision import transforms as T  # the package __init__ has installed the torchvision shim

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RANDAUG_OPS = ("Identity", "AutoContrast", "Equalize", "Brightness", "Sharpness", "ShearX", "ShearY",
               "TranslateX", "TranslateY", "Rotate")
TRANSLATE_FRACTION = 10 / 256  # ALBEF: translate_const = 10 pixels at 256 px


class CaptionSafeRandAugment(T.RandAugment):
    """torchvision's RandAugment restricted to ALBEF/mPLUG's op list, with ALBEF's translation range."""

    def _augmentation_space(self, num_bins: int, image_size: tuple[int, int]) -> dict:
        # the same values every call for a size: built once (torchvision builds ~14 tensors per image)
        key = (num_bins, tuple(image_size))
        cache = self.__dict__.setdefault("_space_cache", {})
        if key not in cache:
            space = super()._augmentation_space(num_bins, image_size)
            space["TranslateX"] = (torch.linspace(0.0, TRANSLATE_FRACTION * image_size[1], num_bins), True)
            space["TranslateY"] = (torch.linspace(0.0, TRANSLATE_FRACTION * image_size[0], num_bins), True)
            cache[key] = {name: space[name] for name in RANDAUG_OPS}
        return cache[key]


INTERPOLATIONS = ("bicubic", "bilinear", "nearest")
TRAIN_CROP_SCALE = (0.5, 1.0)


def interpolation_mode(name: str) -> T.InterpolationMode:
    if name not in INTERPOLATIONS:
        raise ValueError(f"interpolation: expected one of {', '.join(INTERPOLATIONS)}, got {name!r}")
    return T.InterpolationMode(name)


def build_train_transform(image_size: int, mean: tuple = CLIP_MEAN, std: tuple = CLIP_STD,
                          interpolation: str = "bicubic", crop_scale: tuple = TRAIN_CROP_SCALE) -> T.Compose:
    return T.Compose([
        T.RandomResizedCrop(image_size, scale=tuple(crop_scale), interpolation=interpolation_mode(interpolation)),
        CaptionSafeRandAugment(num_ops=2, magnitude=7, num_magnitude_bins=11),
        T.ToTensor(),
        T.Normalize(mean, std),
    ])


def build_train_transform_uint8(image_size: int, interpolation: str = "bicubic",
                                crop_scale: tuple = TRAIN_CROP_SCALE) -> T.Compose:
    """PIL RGB -> uint8 [3, image_size, image_size]: the training augmentation without ToTensor / Normalize
    (``DeviceNormalize`` does them on the training device), the crop resized by ``TorchResizedCrop``."""
    from mplug_pretrain.data.resized_crop import TorchResizedCrop
    return T.Compose([
        TorchResizedCrop(image_size, scale=tuple(crop_scale), interpolation=interpolation_mode(interpolation)),
        CaptionSafeRandAugment(num_ops=2, magnitude=7, num_magnitude_bins=11),
        T.PILToTensor(),
    ])


def build_eval_transform(image_size: int, mean: tuple = CLIP_MEAN, std: tuple = CLIP_STD,
                         interpolation: str = "bicubic") -> T.Compose:
    return T.Compose([
        T.Resize(image_size, interpolation=interpolation_mode(interpolation)),
        T.CenterCrop(image_size),
        T.ToTensor(),
        T.Normalize(mean, std),
    ])


def build_eval_transform_uint8(image_size: int, interpolation: str = "bicubic") -> T.Compose:
    """The eval transform without ToTensor / Normalize: PIL RGB -> uint8 [3, image_size, image_size]."""
    return T.Compose([
        T.Resize(image_size, interpolation=interpolation_mode(interpolation)),
        T.CenterCrop(image_size),
        T.PILToTensor(),
    ])


def seeded_transform(transform, image, seed: int) -> torch.Tensor:
    """``transform(image)`` with torch's CPU generator seeded for this call only (torchvision's random
    transforms draw from it); the caller's RNG state is restored and CUDA generators are untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return transform(image)
