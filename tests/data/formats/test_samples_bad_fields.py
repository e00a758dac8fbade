"""Issue 24, item 2: one sample's fields never end a run. JSON fields of a foreign type or range (an image id
"²" that ``str.isdigit`` accepts but ``int`` refuses, an integer beyond int64 that the batch's long tensor
cannot hold, captions that are not a list), an exception no check foresaw while decoding, and a sample the
collate function refuses are each skipped and counted under their kind; every other sample is batched."""
import collections
import os

import pytest
import torch

from mplug_pretrain.data.formats.samples import image_id_of
from mplug_pretrain.data.reading.decode_stats import KINDS, DecodeStats, sum_over_ranks
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_caption_eval_loader, build_pretrain_loader
from mplug_pretrain.data.reading.stages import batch_by_position, decode_samples
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from tests.data.shard_samples import jpeg_bytes, simple_sample

BAD_JSON = {  # key -> (json, the kind it is counted under, or None: kept)
    "superscript": ({"image_id": "²"}, None),  # a string id: kept under a stable hashed id
    "huge": ({"image_id": 2**70}, "bad_image_id"),
    "hugetext": ({"image_id": "9" * 25}, "bad_image_id"),
    "notobject": ([1, 2, 3], "bad_json"),
}


def write_bad_json_shard(folder: str, good: int) -> str:
    with ShardWriter(folder, "badjson", kind="image-text", created_by="test") as writer:
        for i in range(good):
            writer.write(simple_sample(i, "good"))
        for key, (meta, _) in BAD_JSON.items():
            writer.write({"__key__": key, "jpg": jpeg_bytes((1, 2, 3)), "txt": "a caption", "json": meta})
    return os.path.join(folder, "badjson-000000.tar")


def test_image_id_fields_of_any_json_value():
    sample = {"__key__": "k", "__url__": "/x/a.tar"}
    assert image_id_of({"image_id": 17}, sample) == 17
    assert image_id_of({"image_id": "0042"}, sample) == 42
    assert image_id_of({"image_id": 2**63 - 1}, sample) == 2**63 - 1
    hashed = image_id_of({"image_id": "²"}, sample)
    assert 0 <= hashed < 2**62 and hashed == image_id_of({"image_id": "²"}, {"__key__": "other"})
    torch.tensor([hashed], dtype=torch.long)  # fits the batch tensor


@pytest.mark.parametrize("workers", [0, 1])
def test_a_shard_with_bad_json_fields_is_read_through(tmp_path, tokenizer, workers):
    shard = write_bad_json_shard(str(tmp_path), good=6)
    loader = build_pretrain_loader(LoaderSpec(shard, batch_size=4, num_workers=workers, seed=1), tokenizer,
                                   image_size=16, max_text_len=8, augment=False)
    batches = list(loader)
    assert len(batches) == loader.num_batches
    real = [k for b in batches for k, pad in zip(b["__key__"], b["is_pad"].tolist()) if not pad]
    expected_kept = [f"good{i:05d}" for i in range(6)] + [k for k, (_, kind) in BAD_JSON.items() if kind is None]
    assert collections.Counter(real) == collections.Counter(expected_kept)
    expected = collections.Counter(kind for _, kind in BAD_JSON.values() if kind)
    assert loader.stats.skipped == dict(expected)


def test_caption_lists_of_the_wrong_type_are_bad_json(tmp_path):
    with ShardWriter(str(tmp_path), "caps", kind="image-text", created_by="test") as writer:
        writer.write({"__key__": "ok", "jpg": jpeg_bytes((9, 9, 9)), "json": {"image_id": 1, "captions": ["a b"]}})
        writer.write({"__key__": "str", "jpg": jpeg_bytes((9, 9, 9)), "json": {"image_id": 2, "captions": "a b"}})
    loader = build_caption_eval_loader(LoaderSpec.evaluation(os.path.join(str(tmp_path), "caps-000000.tar"),
                                                              batch_size=2, num_workers=0), image_size=16)
    batches = list(loader)
    assert [k for b in batches for k, pad in zip(b["__key__"], b["is_pad"].tolist()) if not pad] == ["ok"]
    assert loader.stats.skipped == {"bad_json": 1}


def _numbered(keys):
    return [{"__key__": k, "__pos__": i} for i, k in enumerate(keys)]


def test_an_unforeseen_decode_exception_skips_that_sample_only():
    def decode(sample):
        if sample["__key__"] == "boom":
            raise TypeError("unsupported operand")
        return {"__key__": sample["__key__"]}
    stats = DecodeStats()
    out = list(decode_samples(iter(_numbered(["a", "boom", "c"])), decode=decode, stats=stats))
    assert [s["__key__"] for s in out] == ["a", "c"] and [s["__pos__"] for s in out] == [0, 2]
    assert stats.skipped == {"decode_error": 1}


def test_a_sample_the_collate_refuses_is_dropped_and_padded():
    def collate(samples, is_pad):
        if any(s["__key__"] == "poison" for s in samples):
            raise OverflowError("Overflow when unpacking long long")
        return {"__key__": [s["__key__"] for s in samples], "is_pad": list(is_pad)}
    stats = DecodeStats()
    batches = list(batch_by_position(iter(_numbered(["a", "poison", "c", "d", "e", "f"])), batch_size=3,
                                     first_batch=0, num_batches=2, collate=collate, blank=lambda: {"__key__": ""},
                                     stats=stats))
    assert [b["__key__"] for b in batches] == [["a", "c", "a"], ["d", "e", "f"]]
    assert [b["is_pad"] for b in batches] == [[False, False, True], [False, False, False]]
    assert stats.skipped == {"collate_error": 1} and stats.counts["padded"] == 1


def test_sum_over_ranks_in_one_process_keeps_every_kind():
    counts = {"decoded": 5, "bad_json": 2, "a_new_kind": 3}
    assert sum_over_ranks(counts) == {"decoded": 5, "bad_json": 2, "other": 3}
    assert "other" in KINDS
