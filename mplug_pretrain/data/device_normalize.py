"""``DeviceNormalize``: uint8 images [B, 3, H, W] -> float32 ``(x / 255 - mean) / std``, run where the images
are (the training step's device), once per batch.

The loader's workers send uint8 (4x fewer bytes through shared memory and the host-to-device copy, no float work
in the workers); the loop (train/loop.py ``_to_device``) calls this after the copy. The operations and their order
are torchvision's ``ToTensor`` then ``Normalize``, so the result is the float path's, bit for bit on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceNormalize:
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != len(self.mean):
            raise ValueError(f"expected uint8 images [B, {len(self.mean)}, H, W], got {images.dtype} "
                             f"{list(images.shape)}")
        x = images.to(torch.float32).div(255)
        mean = torch.as_tensor(self.mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        return x.sub_(mean).div_(std)
