"""The rest of an interrupted epoch re-split over another layout (data/reading/resplit.py): the replayed
consumption against a literal walk of the old slots' streams, and real loaders on real shards, where the keys
the old layout consumed plus those every new rank yields are the epoch's keys, each once."""
import collections
import random

import pytest
import torch

from mplug_pretrain.data.reading.epoch_plan import ExactPlan, derive_seed, local_skip, slot_seed
from mplug_pretrain.data.reading.loader_spec import LoaderSpec, ResplitPoint
from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
from mplug_pretrain.data.reading.resplit import exact_remainder, remaining_samples
from mplug_pretrain.data.reading.stages import seeded_shuffle
from mplug_pretrain.errors import ConfigError
from tests.data.reading.test_epoch_plan import random_shards
from tests.data.shard_samples import write_simple_shards


def walk(plan: ExactPlan, epoch: int, global_slot: int, buffer: int, whole: ExactPlan | None = None,
         keep=None) -> list[tuple[str, int]]:
    """A slot's stream of (shard, index in shard), literally: its shards in order (each holding the samples
    ``whole`` counts), [the kept indices], every S-th, the seeded shuffle buffer (pipeline.ShardStream's stages)."""
    a = plan.assignment(epoch, global_slot)
    counts = dict(zip((whole or plan).shards, (whole or plan).counts))
    raw = [(s, i) for s in a.shards for i in range(counts[s]) if keep is None or s not in keep or i in keep[s]]
    mine = iter([x for j, x in enumerate(raw) if j % a.stride == a.offset])
    if plan.shuffle:
        mine = seeded_shuffle(buffer, derive_seed(slot_seed(plan.seed, epoch, global_slot), "samples"))(mine)
    return list(mine)


@pytest.mark.parametrize("trial", range(60))
def test_remaining_samples_match_a_literal_walk(trial):
    rng = random.Random(trial)
    shards, counts = random_shards(rng, 10, 25)
    epoch, seed, buffer, shuffle = rng.randint(0, 3), trial, rng.choice([1, 3, 8, 1000]), trial % 4 != 0
    old = ExactPlan(shards, counts, world_size=rng.randint(1, 3), workers=rng.randint(1, 3),
                    batch_size=rng.randint(1, 6), shuffle=shuffle, seed=seed)
    batches = rng.randint(0, old.num_batches)
    consumed = []
    for g in range(old.num_slots):
        consumed += walk(old, epoch, g, buffer)[:local_skip(batches, g % old.workers, old.workers) * old.batch_size]
    everything = [(s, i) for s, c in zip(shards, counts) for i in range(c)]
    left = collections.Counter(everything) - collections.Counter(consumed)
    assert len(consumed) == len(set(consumed)) and sum(left.values()) == len(everything) - len(consumed)

    counts_left, keep = remaining_samples(old, epoch, batches, buffer)
    assert counts_left == [sum(1 for s, _ in left if s == shard) for shard in shards]
    for s, indices in keep.items():  # only shards read in part are listed
        assert 0 < len(indices) < counts[s] and set(indices) == {i for shard, i in left if shard == shards[s]}

    new = ExactPlan(shards, counts, world_size=rng.randint(1, 3), workers=rng.randint(1, 3),
                    batch_size=rng.randint(1, 6), shuffle=shuffle, seed=seed)
    rest = exact_remainder(new, ResplitPoint(old.world_size, old.workers, old.batch_size, batches), epoch=epoch,
                           shuffle_buffer=buffer)
    assert rest.first_batch == batches
    if not left:
        assert rest.batches_per_slot == 0 and rest.plan is None
        return
    yielded = []
    for g in range(rest.plan.num_slots):
        stream = walk(rest.plan, epoch, g, buffer, whole=new, keep=rest.keep)
        assert len(stream) <= rest.batches_per_slot * new.batch_size
        yielded += stream
    assert collections.Counter(yielded) == left


def test_position_outside_the_old_epoch_or_before_the_resplit_is_refused():
    with pytest.raises(ConfigError, match="re-split epoch starts after"):
        LoaderSpec("x.tar", 4, start_batch=2, resplit_from=(2, 1, 4, 3))
    with pytest.raises(ConfigError, match="resplit_from"):
        LoaderSpec("x.tar", 4, resplit_from=(2, 1))
    plan = ExactPlan(["a.tar"], [10], world_size=1, workers=1, batch_size=2, shuffle=True, seed=0)
    with pytest.raises(ConfigError, match="6 batches per rank consumed"):
        exact_remainder(plan, ResplitPoint(2, 0, 2, 6), epoch=0, shuffle_buffer=4)


UNEVEN = [7, 13, 5, 9, 11, 3, 8, 4]  # 60 samples: shard split for up to 4 slots
ONE_SHARD = [22]  # sample split whenever there are 2 slots or more
BATCH, SEED, EPOCH, BUFFER = 4, 7, 2, 6  # a buffer smaller than the shards: some are read in part at the stop


@pytest.fixture(scope="module")
def data(module_mktemp):
    folder = module_mktemp("resplit")
    return {"shards": write_simple_shards(str(folder / "many"), UNEVEN),
            "one_shard": write_simple_shards(str(folder / "one"), ONE_SHARD)}


def loader(urls, tokenizer, **spec):
    spec = LoaderSpec(urls, **{"batch_size": BATCH, "seed": SEED, "shuffle": True, "shuffle_buffer": BUFFER,
                               "epoch": EPOCH, **spec})
    return build_pretrain_loader(spec, tokenizer, image_size=16, max_text_len=8, augment=True)


def real_keys(batches):
    return [k for b in batches for k, pad in zip(b["__key__"], b["is_pad"].tolist()) if not pad]


def consumed_keys(urls, tokenizer, world_size, num_workers, batches):
    """The real keys the first ``batches`` batches of every rank of an uninterrupted loader hold."""
    return [k for rank in range(world_size)
            for k in real_keys(list(loader(urls, tokenizer, num_workers=num_workers, rank=rank,
                                           world_size=world_size))[:batches])]


SPLITS = {  # (data, old layout, new layout) -> the old epoch's split, the re-split's: every kind meets every kind
    ("shards", (2, 1), (1, 1)): ("shard", "shard"), ("shards", (1, 1), (2, 1)): ("shard", "shard"),
    ("shards", (2, 2), (3, 1)): ("shard", "sample"), ("one_shard", (2, 1), (1, 1)): ("sample", "shard"),
    ("one_shard", (1, 1), (2, 1)): ("shard", "sample"), ("one_shard", (2, 2), (3, 1)): ("sample", "sample")}


@pytest.mark.parametrize("old,new", [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 2), (3, 1))])
@pytest.mark.parametrize("which", ["shards", "one_shard"])
def test_rest_of_the_epoch_on_another_layout_yields_every_sample_once(which, old, new, data, tokenizer):
    urls, keys = data[which]
    (old_world, old_workers), (new_world, new_workers) = old, new
    first = loader(urls, tokenizer, num_workers=old_workers, world_size=old_world, rank=0)
    batches = max(1, first.num_batches * 3 // 8)  # 3 of 8: the 2-worker layout's slots stopped at different batches
    consumed = consumed_keys(urls, tokenizer, old_world, old_workers, batches)
    rest, lengths = [], []
    for rank in range(new_world):
        resumed = loader(urls, tokenizer, num_workers=new_workers, rank=rank, world_size=new_world,
                         start_batch=batches, resplit_from=(old_world, old_workers, BATCH))
        out = list(resumed)
        assert len(out) == len(resumed) == resumed.num_batches - batches
        assert all(b["image"].shape[0] == BATCH for b in out)
        remainder = resumed.stream.remainder
        assert (first.stream.plan.split, remainder.plan.split) == SPLITS[which, old, new] and remainder.keep
        lengths.append(len(out))
        rest += real_keys(out)
    assert len(set(lengths)) == 1  # every new rank yields as many batches (DeepSpeed's collectives stay in step)
    assert collections.Counter(consumed + rest) == collections.Counter(keys)


@pytest.mark.parametrize("new_batch", [2 * BATCH, BATCH - 1])
def test_rest_of_the_epoch_with_another_batch_size_yields_every_sample_once(new_batch, data, tokenizer):
    """An accepted data.batch_size change (or one re-derived to keep the global batch) re-splits the rest of the
    epoch too: nothing skipped, nothing seen twice."""
    urls, keys = data["shards"]
    consumed = consumed_keys(urls, tokenizer, 2, 1, 3)
    rest = []
    for rank in range(2):
        out = list(loader(urls, tokenizer, batch_size=new_batch, num_workers=1, rank=rank, world_size=2,
                          start_batch=3, resplit_from=(2, 1, BATCH)))
        assert out and all(b["image"].shape[0] == new_batch for b in out)
        rest += real_keys(out)
    assert collections.Counter(consumed + rest) == collections.Counter(keys)


def test_next_epochs_follow_the_new_layout_and_a_second_stop_resumes(data, tokenizer):
    """After the re-split epoch the same (persistent-worker) loader walks the new layout's ordinary epochs; a stop
    inside the re-split epoch resumes on the same layout with the point and the batches counted on."""
    urls, _ = data["shards"]
    point = (2, 2, BATCH, 3)
    whole = loader(urls, tokenizer, num_workers=1, start_batch=3, resplit_from=point)
    rest = list(whole)
    again = loader(urls, tokenizer, num_workers=1, start_batch=5, resplit_from=point)
    assert len(again) == len(rest) - 2 and real_keys(list(again)) == real_keys(rest[2:])
    whole.set_epoch(EPOCH + 1)
    assert whole.num_batches == len(whole) == loader(urls, tokenizer, epoch=EPOCH + 1).num_batches
    assert real_keys(list(whole)) == real_keys(list(loader(urls, tokenizer, num_workers=1, epoch=EPOCH + 1)))
    with pytest.raises(ConfigError, match="outside 3.."):
        whole.set_epoch(EPOCH, 0)


def test_an_epoch_stopped_at_its_end_has_nothing_left(data, tokenizer):
    urls, _ = data["one_shard"]
    end = loader(urls, tokenizer, num_workers=2, world_size=2, rank=0).num_batches
    done = loader(urls, tokenizer, num_workers=1, start_batch=end, resplit_from=(2, 2, BATCH))
    assert done.num_batches == end and len(done) == 0 and list(done) == []
    done.set_epoch(EPOCH + 1)
    assert len(list(done)) == done.num_batches > 0


@pytest.mark.parametrize("which", ["shards", "one_shard"])
def test_resplit_point_of_the_same_layout_is_the_ordinary_resume(which, data, tokenizer):
    urls, _ = data[which]
    kw = {"num_workers": 2, "world_size": 2, "rank": 1}
    for start in (1, 3):
        today = list(loader(urls, tokenizer, start_batch=start, **kw))
        resplit = list(loader(urls, tokenizer, start_batch=start, resplit_from=(2, 2, BATCH), **kw))
        assert len(today) == len(resplit) > 0
        for x, y in zip(today, resplit):
            assert x["__key__"] == y["__key__"] and torch.equal(x["is_pad"], y["is_pad"])
            assert torch.equal(x["image"], y["image"]) and torch.equal(x["input_ids"], y["input_ids"])


def test_resampled_rest_of_the_budget(data, tokenizer):
    urls, keys = data["shards"]
    kw = {"mode": "resampled", "samples_per_epoch": 100, "start_batch": 2, "resplit_from": (2, 1, BATCH)}
    rest = [list(loader(urls, tokenizer, rank=rank, world_size=3, **kw)) for rank in range(3)]
    # 100 - 2 batches x 2 ranks x 4 = 84 samples left: ceil(84 / (3 x 4)) = 7 batches per rank
    assert [len(r) for r in rest] == [7, 7, 7]
    assert set(real_keys(b for r in rest for b in r)) <= set(keys)
