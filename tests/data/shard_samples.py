"""Small shard sets for the data tests, written with the real writer: one-colour JPEGs, simple samples, shards of
uneven sizes."""
import io
import os
import tarfile
from functools import cache

from PIL import Image

import mplug_pretrain  # noqa: F401  (torchvision shim before anything imports it)
from mplug_pretrain.data.writers.shard_writer import ShardWriter

PALETTE = [(200, 30, 30), (30, 160, 40), (40, 60, 220), (230, 200, 40), (140, 40, 180), (20, 20, 20), (240, 240, 240)]


@cache
def jpeg_bytes(color: tuple, size: int = 24) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def simple_sample(i: int, prefix: str = "s") -> dict:
    return {"__key__": f"{prefix}{i:05d}", "jpg": jpeg_bytes(PALETTE[i % len(PALETTE)]),
            "txt": f"caption number {i} " + "word " * (i % 5), "json": {"image_id": i}}


def write_simple_shards(folder: str, sizes: list[int], name: str = "part", prefix: str = "s") -> tuple[str, list[str]]:
    """Shards of uneven sizes (one ShardWriter data set each: NAME000-000000.tar, NAME001-...);
    returns (brace pattern naming them all, keys in write order)."""
    os.makedirs(folder, exist_ok=True)
    keys, i = [], 0
    for shard_index, size in enumerate(sizes):
        shard_name = f"{name}{shard_index:03d}"
        with ShardWriter(folder, shard_name, kind="image-text", created_by="test", max_samples=size) as writer:
            for _ in range(size):
                sample = simple_sample(i, prefix)
                writer.write(sample)
                keys.append(sample["__key__"])
                i += 1
    return os.path.join(folder, f"{name}{{000..{len(sizes) - 1:03d}}}-000000.tar"), keys


def read_samples(tar_path) -> list[dict]:
    """Every sample of one tar as {field: bytes}, in key order (read with tarfile, not our reader)."""
    samples = {}
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            key, _, field = member.name.partition(".")
            samples.setdefault(key, {})[field] = tar.extractfile(member).read()
    return [samples[k] for k in sorted(samples)]
