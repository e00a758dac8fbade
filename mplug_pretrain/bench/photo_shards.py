"""Real-size photo shards for the loader benches: scikit-image's offline photos (astronaut, coffee, rocket, ...),
each sample a seeded 4:3 crop resized to 640 x 480 (COCO's typical size), flipped at random, JPEG quality 80-95,
with a short caption. Written once under ``data_shards/bench_photos_640x480/`` (git-ignored) and reused."""
from __future__ import annotations

import io
import logging
import os
import random

import numpy as np
from PIL import Image

PHOTO_NAMES = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "camera",
               "coins", "moon", "page", "text", "brick", "grass", "gravel")
SIZE = (640, 480)
log = logging.getLogger(__name__)


def offline_photos() -> list[tuple[str, Image.Image]]:
    """The photos scikit-image ships (those it would download are left out)."""
    from skimage import data
    photos = []
    for name in PHOTO_NAMES:
        try:
            pixels = getattr(data, name)()
        except Exception as err:  # noqa: BLE001 (a photo skimage would fetch from the network)
            log.info("bench photos: %s left out (%s)", name, err)
            continue
        photos.append((name, Image.fromarray(np.ascontiguousarray(pixels)).convert("RGB")))
    return photos


def _sample_jpeg(photo: Image.Image, rng: random.Random) -> bytes:
    w, h = photo.size
    crop_w = min(w, int(h * 4 / 3)) * rng.uniform(0.6, 1.0)
    crop_h = crop_w * 3 / 4
    left, top = rng.uniform(0, w - crop_w), rng.uniform(0, max(0.0, h - crop_h))
    image = photo.resize(SIZE, Image.BICUBIC, box=(left, top, left + crop_w, min(h, top + crop_h)))
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=rng.randint(80, 95))
    return buf.getvalue()


def ensure_photo_shards(samples: int = 512, shards: int = 4, root: str = "data_shards") -> str:
    """-> the brace pattern of ``shards`` shards holding ``samples`` 640 x 480 photo samples."""
    from mplug_pretrain.data.writers.shard_writer import ShardWriter
    folder = os.path.join(root, f"bench_photos_640x480_{samples}")
    pattern = os.path.join(folder, f"photos-{{000000..{shards - 1:06d}}}.tar")
    last = os.path.join(folder, f"photos-{shards - 1:06d}.tar")
    if os.path.exists(os.path.join(folder, "manifest.json")) and os.path.exists(last):
        return pattern
    photos, rng = offline_photos(), random.Random(0)
    per_shard = -(-samples // shards)
    with ShardWriter(folder, "photos", kind="image-text", created_by="bench.photo_shards",
                     max_samples=per_shard) as writer:
        for i in range(samples):
            name, photo = photos[i % len(photos)]
            writer.write({"__key__": f"photo{i:06d}", "jpg": _sample_jpeg(photo, rng),
                          "txt": f"a photo of the {name.replace('_', ' ')} number {i}"})
    return pattern
