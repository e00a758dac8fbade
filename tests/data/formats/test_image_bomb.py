"""Decompression bombs (issue 37 item 3): an image over data.max_image_pixels is skipped from its header, before
any pixel is decoded, counted as ``too_many_pixels``; PIL's own limit is set to the same cap."""
import json
import struct
import subprocess
import sys
import zlib
from functools import cache

import pytest
from PIL import Image

from mplug_pretrain.config import load_config
from mplug_pretrain.data.formats.image_decode import (
    DEFAULT_MAX_IMAGE_PIXELS,
    SampleError,
    decode_image,
    set_max_image_pixels,
)
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from mplug_pretrain.errors import ConfigError
from tests.data.photo_samples import photo_jpeg
from tests.helpers import REPO_ROOT

BOMB_SIDE = 12_500  # 16-bit grey: 156 Mpx, 312 MB as pixels, 8-bit RGB after to_rgb: 469 MB more


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


@cache
def bomb_png(side: int = BOMB_SIDE) -> bytes:
    """A 16-bit greyscale PNG of side x side zeros, compressed row by row (the test never holds the pixels)."""
    compressor, parts = zlib.compressobj(9), []
    row = b"\x00" * (1 + 2 * side)  # filter byte 0, then 2 bytes per pixel
    for _ in range(side):
        parts.append(compressor.compress(row))
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", side, side, 16, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", b"".join(parts)) + _chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def bomb_shard(module_mktemp):
    folder = module_mktemp("bomb")
    with ShardWriter(str(folder), "b", kind="image-text", created_by="test") as writer:
        for i in range(3):
            writer.write({"__key__": f"ok{i}", "jpg": photo_jpeg(i), "txt": f"photo {i}"})
        writer.write({"__key__": "bomb", "png": bomb_png(), "txt": "a bomb"})
    return str(folder / "b-000000.tar")


def test_the_bomb_is_small_on_disk_and_huge_in_pixels():
    data = bomb_png()
    assert len(data) < 1_000_000
    width, height, depth = struct.unpack(">IIB", data[16:25])  # IHDR, read by hand: PIL refuses to open it now
    assert (width, height, depth) == (BOMB_SIDE, BOMB_SIDE, 16)
    assert zlib.decompressobj().decompress(data[41:41 + 1_000_000], 4096)[:3] == b"\x00\x00\x00"
    with pytest.raises(SampleError) as err:
        decode_image(data)
    assert err.value.kind == "too_many_pixels"


def test_loader_skips_the_bomb_at_bounded_memory_and_time(bomb_shard):
    """In a fresh process (its peak RSS is this loader's alone): 3 photos decoded, the bomb counted as
    too_many_pixels; before the cap it decoded at ~4 GB peak RSS in 4-13 s (issue 37)."""
    code = f"""
import json, resource, time
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
from mplug_pretrain.data.tokenizer import load_tokenizer
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
loader = build_pretrain_loader(LoaderSpec({bomb_shard!r}, 4, 0, rank=0, world_size=1, shuffle=False),
                               load_tokenizer(), image_size=32, max_text_len=8, augment=True, uint8_images=True)
batches = list(loader)
print(json.dumps({{"seconds": time.perf_counter() - start, "counts": loader.stats.as_dict(),
                  "keys": [k for b in batches for k, pad in zip(b["__key__"], b["is_pad"].tolist()) if not pad],
                  "rss_before_kb": before, "rss_peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["counts"]["too_many_pixels"] == 1 and result["counts"]["decoded"] == 3, result
    assert sorted(result["keys"]) == ["ok0", "ok1", "ok2"]
    # the 16-bit pixels alone are 312 MB: a decode would show in the growth (the imports' own RSS, about 1 GB with
    # torch on some installs, is the baseline, not a bound)
    assert result["rss_peak_kb"] - result["rss_before_kb"] < 150_000, result
    assert result["seconds"] < 30, result  # tokenizer and reader start-up included; a decode took 4-13 s alone
    assert "DecompressionBomb" not in proc.stderr


def test_cap_is_read_from_the_header_and_is_configurable():
    small = photo_jpeg(0, (40, 30))
    assert decode_image(small).size == (40, 30)
    try:
        set_max_image_pixels(40 * 30 - 1)
        assert Image.MAX_IMAGE_PIXELS == 40 * 30 - 1  # PIL's own limit follows ours
        with pytest.raises(SampleError) as err:
            decode_image(small)
        assert err.value.kind == "too_many_pixels" and "1199-pixel cap (data.max_image_pixels)" in str(err.value)
        set_max_image_pixels(40 * 30)
        assert decode_image(small).size == (40, 30)
    finally:
        set_max_image_pixels(DEFAULT_MAX_IMAGE_PIXELS)
    assert Image.MAX_IMAGE_PIXELS == DEFAULT_MAX_IMAGE_PIXELS == 64 * 2**20


def test_loader_spec_cap_reaches_the_workers(tmp_path):
    with ShardWriter(str(tmp_path), "p", kind="image-text", created_by="test") as writer:
        writer.write({"__key__": "big", "jpg": photo_jpeg(0, (64, 48)), "txt": "big"})
        writer.write({"__key__": "small", "jpg": photo_jpeg(1, (32, 24)), "txt": "small"})
    spec = LoaderSpec(str(tmp_path / "p-000000.tar"), 2, 1, rank=0, world_size=1, max_image_pixels=32 * 24)
    from mplug_pretrain.data.tokenizer import load_tokenizer
    loader = build_pretrain_loader(spec, load_tokenizer(), image_size=16, max_text_len=8, augment=False)
    (batch,) = list(loader)
    assert [k for k, pad in zip(batch["__key__"], batch["is_pad"].tolist()) if not pad] == ["small"]
    assert loader.stats.counts["too_many_pixels"] == 1
    assert Image.MAX_IMAGE_PIXELS == DEFAULT_MAX_IMAGE_PIXELS  # the worker's setting stayed in the worker


@pytest.mark.parametrize("value", ["0", "-5"])
def test_config_refuses_a_cap_below_one(value):
    with pytest.raises(ConfigError, match="data.max_image_pixels"):
        load_config(None, [f"data.max_image_pixels={value}"], check_paths=False)


def test_loader_spec_refuses_a_cap_below_one():
    with pytest.raises(ConfigError, match="data.max_image_pixels"):
        LoaderSpec("x.tar", 2, max_image_pixels=0)
