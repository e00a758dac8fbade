"""Reader pipeline: exact epochs across 2 nodes x 2 workers, equal batch counts, determinism,
resume, resampled epochs, weighted sources, the batch contract."""
import collections
import math
import os

import pytest
import torch
from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
from mplug_pretrain.errors import ConfigError
from tests.data.shard_samples import write_simple_shards

UNEVEN = [7, 13, 5, 9, 11, 3, 8, 4]  # 60 samples


@pytest.fixture(scope="module")
def uneven(module_mktemp):
    return write_simple_shards(str(module_mktemp("uneven")), UNEVEN)


@pytest.fixture(scope="module")
def single(module_mktemp):
    return write_simple_shards(str(module_mktemp("single")), [22])


def loader(urls, tokenizer, max_text_len=16, train=False, **spec):
    """``train``: shuffled and augmented; ``spec``: LoaderSpec fields."""
    spec = LoaderSpec(urls, **{"batch_size": 4, "num_workers": 2, "seed": 7, "shuffle": train, **spec})
    return build_pretrain_loader(spec, tokenizer, image_size=16, max_text_len=max_text_len, augment=train)


def real_keys(batches):
    return [k for b in batches for k, pad in zip(b["__key__"], b["is_pad"].tolist()) if not pad]


@pytest.mark.parametrize("which", ["uneven", "single"])  # shard split / sample split (fewer shards than slots)
def test_exact_two_nodes_two_workers_cover_every_sample_once(which, uneven, single, tokenizer):
    urls, keys = uneven if which == "uneven" else single
    per_rank = []
    for rank in range(2):
        lo = loader(urls, tokenizer, rank=rank, world_size=2, train=True)
        batches = list(lo)
        assert len(batches) == lo.num_batches == len(lo)
        assert all(b["image"].shape[0] == 4 and b["is_pad"].shape == (4,) for b in batches)
        per_rank.append(batches)
    assert len(per_rank[0]) == len(per_rank[1])
    seen = real_keys(per_rank[0]) + real_keys(per_rank[1])
    assert collections.Counter(seen) == collections.Counter(keys)
    assert not set(real_keys(per_rank[0])) & set(real_keys(per_rank[1]))


def test_rank_from_environment(uneven, tokenizer, monkeypatch):
    urls, keys = uneven
    seen = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        seen += real_keys(loader(urls, tokenizer))
    assert sorted(seen) == sorted(keys)


def test_order_is_deterministic_per_seed_and_epoch(uneven, tokenizer):
    urls, keys = uneven
    first = real_keys(loader(urls, tokenizer, train=True, epoch=1))
    again = real_keys(loader(urls, tokenizer, train=True, epoch=1))
    other = real_keys(loader(urls, tokenizer, train=True, epoch=2))
    assert first == again
    assert first != other and sorted(first) == sorted(other) == sorted(keys)


def _same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["__key__"] == y["__key__"]
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["is_pad"], y["is_pad"])


@pytest.mark.parametrize("mode", ["exact", "resampled"])
def test_resume_from_start_batch_repeats_the_rest_of_the_epoch(mode, uneven, tokenizer):
    urls, _ = uneven
    kw = {"train": True, "mode": mode, "epoch": 3, "num_workers": 2}
    full = list(loader(urls, tokenizer, **kw))
    assert len(full) >= 8
    for start in (1, 4, 5):
        _same_batches(list(loader(urls, tokenizer, start_batch=start, **kw)), full[start:])
    resumed = loader(urls, tokenizer, **kw)
    resumed.set_epoch(3, start_batch=5)
    _same_batches(list(resumed), full[5:])


def test_resampled_epoch_length_from_manifest(uneven, tokenizer):
    urls, keys = uneven
    counts = []
    for rank in range(2):
        lo = loader(urls, tokenizer, mode="resampled", rank=rank, world_size=2)
        batches = list(lo)
        counts.append(len(batches))
        assert all(not b["is_pad"].any() for b in batches)
        assert set(real_keys(batches)) <= set(keys)
    # open_clip's rule: ceil(N / global batch) batches, rounded up to a multiple of the workers
    expected = math.ceil(math.ceil(len(keys) / (4 * 2)) / 2) * 2
    assert counts == [expected, expected]


def test_weighted_sources_ratio(tmp_path, tokenizer):
    urls_a, keys_a = write_simple_shards(str(tmp_path / "a"), [10], prefix="a")
    urls_b, keys_b = write_simple_shards(str(tmp_path / "b"), [5], prefix="b")
    lo = loader(f"{urls_a}::{urls_b}", tokenizer, mode="resampled", weights="1::3", samples_per_epoch=1600,
                batch_size=16, num_workers=1)
    keys = real_keys(lo)
    assert len(keys) == 1600
    share_b = sum(k.startswith("b") for k in keys) / len(keys)
    assert abs(share_b - 0.75) < 0.05
    assert set(keys) == set(keys_a) | set(keys_b)


def test_weights_need_resampled_mode(uneven, tokenizer):
    with pytest.raises(ConfigError, match="resampled"):
        loader(uneven[0], tokenizer, weights=[1.0])


def test_batch_contract_and_tokenization(uneven, tokenizer):
    urls, _ = uneven
    slow = BertTokenizerLegacy(os.path.join(tokenizer.name_or_path, "vocab.txt"), do_lower_case=True)
    for batch in loader(urls, tokenizer, max_text_len=8, num_workers=0):
        assert batch["image"].dtype == torch.float32 and batch["image"].shape == (4, 3, 16, 16)
        assert batch["input_ids"].dtype == batch["attention_mask"].dtype == batch["image_id"].dtype == torch.long
        expected = [slow.encode(t, truncation=True, max_length=8) for t in batch["text"]]
        longest = max(len(e) for e in expected)
        assert batch["input_ids"].shape == batch["attention_mask"].shape == (4, longest)
        for row, mask, ids in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist(), expected):
            assert row == ids + [0] * (longest - len(ids))
            assert mask == [1] * len(ids) + [0] * (longest - len(ids))
        assert [int(k[1:]) for k in batch["__key__"]] == batch["image_id"].tolist()
