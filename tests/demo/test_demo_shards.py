"""The embedded demo data is made on first use (by the session's ``demo_shards`` fixture: on a fresh clone, as CI
runs, that is the first call; the marker names the recipe's version, so an older set is made again), reused
afterwards, and feeds the dataloader bench. These tests read the session's set instead of making a second one
(28 s of the suite)."""
import json
import os

import pytest

from mplug_pretrain.bench import dataloader as dataloader_bench
from mplug_pretrain.data.formats.manifest import read_manifest
from mplug_pretrain.data.reading.urls import expand_sources
from mplug_pretrain.demo.shards import ensure_demo_shards
from tests.helpers import REPO_ROOT

DATA_SHARDS = os.path.join(REPO_ROOT, "data_shards")


@pytest.fixture(scope="module")
def demo(demo_shards):
    """The patterns ``ensure_demo_shards`` gives for the checkout's data_shards/ (made by ``demo_shards``)."""
    return ensure_demo_shards(DATA_SHARDS)


def test_demo_shards_made_once_with_expected_sizes(demo):
    paths = demo
    totals = {}
    for key in ("pretrain_train", "pretrain_val", "caption_train", "caption_val", "vqa_train", "vqa_val", "video"):
        shards = expand_sources(paths[key])[0].shards
        assert all(os.path.exists(s) for s in shards)
        manifest = read_manifest(os.path.dirname(shards[0]))
        entry = next(e for e in manifest["datasets"].values() if os.path.basename(shards[0]) in
                     [s["file"] for s in e["shards"]])
        assert len(entry["shards"]) == len(shards)
        totals[key] = entry["total"]
    assert totals == {"pretrain_train": 4000, "pretrain_val": 250, "caption_train": 2000, "caption_val": 200,
                      "vqa_train": 6000, "vqa_val": 1000, "video": 96}
    assert paths["pretrain_train"].endswith("pretrain/train-{000000..000003}.tar")
    with open(paths["vqa_answer_list"]) as f:
        assert len(json.load(f)) == 13
    mtime = os.path.getmtime(expand_sources(paths["pretrain_train"])[0].shards[0])
    assert ensure_demo_shards(DATA_SHARDS) == paths  # made once: the second call rewrites nothing
    assert os.path.getmtime(expand_sources(paths["pretrain_train"])[0].shards[0]) == mtime


def test_dataloader_bench_quick(demo, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the bench uses ./data_shards
    result = dataloader_bench.run(str(tmp_path / "bench.json"), quick=True)
    with open(tmp_path / "bench.json") as f:
        assert json.load(f) == result
    # quick: one in-process round of the loader before and after issue 35, 3 timed batches of 32 each
    assert sorted(row["pipeline"] for row in result["rows"]) == ["after", "before"]
    for row in result["rows"]:
        assert row["workers"] == 0
        assert row["samples"] == 3 * 32 and row["samples_per_s"] == pytest.approx(row["samples"] / row["seconds"])


def test_demo_vocabulary_keeps_bert_special_ids_and_every_demo_text(demo):
    """Every demo text tokenizes to the same words under the demo vocabulary as under BERT's, without [UNK],
    and the ids the decoders hard-code ([PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103) are BERT's."""
    from mplug_pretrain.data.reading.urls import all_shards
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.demo.vocab import shard_texts, vocab_size
    paths = demo
    small, bert = load_tokenizer(paths["tokenizer"]), load_tokenizer()
    for name in ("pad", "unk", "cls", "sep", "mask"):
        assert getattr(small, f"{name}_token_id") == getattr(bert, f"{name}_token_id"), name
    assert vocab_size(paths["tokenizer"]) == len(small.get_vocab()) < 400
    urls = [u for key in ("pretrain_val", "vqa_val", "video") for u in all_shards(expand_sources(paths[key]))]
    texts = sorted(set(shard_texts(urls)))[:2000] + ["a picture of", "Zebras, 3 of them!"]
    ids = small(texts)["input_ids"]
    assert all(small.unk_token_id not in row for row in ids)
    assert small.batch_decode(ids, skip_special_tokens=True) == bert.batch_decode(
        bert(texts)["input_ids"], skip_special_tokens=True)
