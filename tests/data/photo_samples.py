"""Photo JPEGs for the image-path tests: scikit-image's offline photos, resized and encoded by the test."""
import io
from functools import cache

import numpy as np
from PIL import Image

import mplug_pretrain  # noqa: F401  (torchvision shim before anything imports it)

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")


@cache
def photo(index: int, size: tuple[int, int]) -> Image.Image:
    from skimage import data
    pixels = getattr(data, PHOTOS[index % len(PHOTOS)])()
    return Image.fromarray(np.ascontiguousarray(pixels)).convert("RGB").resize(size, Image.BICUBIC)


@cache
def photo_jpeg(index: int, size: tuple[int, int] = (160, 120), quality: int = 90) -> bytes:
    buf = io.BytesIO()
    photo(index, size).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
