"""Each corruption kind injected into shards is skipped and counted, the rest is read, and the
counts from worker processes reach the loader in the main process."""
import collections
import os
import re
import tarfile

import pytest

from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from tests.data.shard_samples import jpeg_bytes, simple_sample

BROKEN = {  # key -> (fields replacing the good ones, counter it must land in)
    "badimg": ({"jpg": b"\x00\x01 definitely not an image"}, "corrupt_image"),
    "halfjpg": ({"jpg": jpeg_bytes((9, 9, 9), 64)[:300]}, "corrupt_image"),
    "zeroimg": ({"jpg": b""}, "empty_image"),
    "nocaption": ({"txt": None}, "missing_caption"),
    "blankcaption": ({"txt": "   "}, "missing_caption"),
    "latin1": ({"txt": "caf\xe9 cr\xe8me".encode("latin-1")}, "bad_caption_encoding"),
}
TRUNCATED_TOTAL = 10
TRUNCATE_AT = 6  # cut the truncated shard inside this sample's first member


@pytest.fixture(scope="module")
def corrupt_shards(module_mktemp):
    folder = str(module_mktemp("corrupt"))
    good = []
    with ShardWriter(folder, "mixed", kind="image-text", created_by="test") as writer:
        for i in range(12):
            sample = simple_sample(i, "good")
            writer.write(sample)
            good.append(sample["__key__"])
            if i < len(BROKEN):
                key, (fields, _) = list(BROKEN.items())[i]
                broken = {**simple_sample(100 + i), "__key__": key, **fields}
                writer.write({k: v for k, v in broken.items() if v is not None})
    with ShardWriter(folder, "cut", kind="image-text", created_by="test") as writer:
        for i in range(TRUNCATED_TOTAL):
            writer.write(simple_sample(i, "cut"))
    path = os.path.join(folder, "cut-000000.tar")
    with tarfile.open(path) as tar:
        member = next(m for m in tar.getmembers() if m.name == f"cut{TRUNCATE_AT:05d}.jpg")
    with open(path, "r+b") as f:
        f.truncate(member.offset_data + 100)
    good += [f"cut{i:05d}" for i in range(TRUNCATE_AT)]
    urls = os.path.join(folder, "mixed-000000.tar") + "::" + path
    return urls, good


@pytest.mark.parametrize("workers", [1, 2])  # 1: shard split; 2: sample split (2 uneven shards)
def test_corrupt_samples_are_skipped_and_counted(corrupt_shards, tokenizer, workers):
    urls, good = corrupt_shards
    lo = build_pretrain_loader(LoaderSpec(urls, batch_size=4, num_workers=workers, seed=3), tokenizer, image_size=16,
                               max_text_len=12, augment=True)
    batches = list(lo)
    assert len(batches) == lo.num_batches
    real = [k for b in batches for k, pad in zip(b["__key__"], b["is_pad"].tolist()) if not pad]
    assert collections.Counter(real) == collections.Counter(good)
    expected = collections.Counter(kind for _, kind in BROKEN.values())
    expected.update({"truncated_tar": 1, "missing_samples": TRUNCATED_TOTAL - TRUNCATE_AT})
    assert lo.stats.skipped == dict(expected)
    assert lo.stats.counts["decoded"] == len(good)
    assert lo.stats.counts["padded"] == lo.num_batches * 4 - len(good)
    assert lo.stats.total_skipped == len(BROKEN) + TRUNCATED_TOTAL - TRUNCATE_AT
    assert "corrupt_image=2" in lo.log_line() and "truncated_tar=1" in lo.log_line()
    # the skipped total is the sum of its breakdown; a broken-off shard is a shard, not a skipped sample
    found = re.fullmatch(r"\[data\] decoded \d+, skipped (\d+) \(([^)]*)\), padded \d+; shards broken off: "
                         r"truncated_tar=1", lo.log_line())
    assert found and int(found[1]) == sum(int(r.split("=")[1]) for r in found[2].split(", ")), lo.log_line()
