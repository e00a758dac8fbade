"""Epoch plans, resume arithmetic and URL expansion against brute-force enumeration."""
import itertools
import math
import random

import pytest

from mplug_pretrain.data.reading.epoch_plan import (
    ExactPlan,
    local_skip,
    logical_slot,
    resampled_batches_per_slot,
)
from mplug_pretrain.data.reading.urls import expand_sources
from mplug_pretrain.errors import ConfigError, DataError


def simulate(plan: ExactPlan, epoch: int):
    """Which (shard, index) samples each global slot yields, by literally walking the assignment."""
    per_slot = []
    for g in range(plan.num_slots):
        a = plan.assignment(epoch, g)
        stream = [(shard, i) for shard in a.shards for i in range(plan.counts[plan.shards.index(shard)])]
        mine = [s for j, s in enumerate(stream) if j % a.stride == a.offset]
        assert len(mine) == a.expected
        assert len(mine) <= plan.batches_per_slot * plan.batch_size
        per_slot.append(mine)
    return per_slot


def random_shards(rng: random.Random, most_shards: int, most_samples: int) -> tuple[list[str], list[int]]:
    """1..most_shards shard names and their sample counts (0..most_samples; the first one not empty)."""
    counts = [rng.randint(0, most_samples) for _ in range(rng.randint(1, most_shards))]
    counts[0] = max(counts[0], 1)
    return [f"s{i}.tar" for i in range(len(counts))], counts


@pytest.mark.parametrize("trial", range(40))
def test_exact_plan_covers_every_sample_once(trial):
    rng = random.Random(trial)
    shards, counts = random_shards(rng, 12, 30)
    plan = ExactPlan(shards, counts, world_size=rng.randint(1, 3), workers=rng.randint(1, 3),
                     batch_size=rng.randint(1, 8), shuffle=bool(trial % 2), seed=trial)
    for epoch in (0, 1):
        per_slot = simulate(plan, epoch)
        everything = [s for slot in per_slot for s in slot]
        assert sorted(everything) == sorted((s, i) for s, c in zip(shards, counts) for i in range(c))
    ideal = math.ceil(math.ceil(sum(counts) / plan.num_slots) / plan.batch_size)
    assert plan.batches_per_slot <= max(ideal, int(1.1 * ideal))


def test_shard_split_balances_and_varies_by_epoch():
    shards = [f"s{i}.tar" for i in range(16)]
    plan = ExactPlan(shards, [100] * 16, world_size=2, workers=2, batch_size=10, shuffle=True, seed=0)
    assert plan.split == "shard" and plan.batches_per_slot == 40 and plan.num_batches == 80
    assert plan.assignment(0, 0).shards != plan.assignment(1, 0).shards
    assert plan.assignment(0, 0) == ExactPlan(shards, [100] * 16, world_size=2, workers=2, batch_size=10,
                                              shuffle=True, seed=0).assignment(0, 0)


def test_empty_data_is_an_error():
    with pytest.raises(DataError, match="no samples"):
        ExactPlan(["a.tar"], [0], world_size=1, workers=1, batch_size=2, shuffle=False, seed=0)


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_resume_rotation_matches_round_robin(workers):
    per_slot = 5
    order = [(k % workers, k // workers) for k in range(workers * per_slot)]  # uninterrupted: (slot, local batch)
    for start in range(len(order) + 1):
        queues = {}
        for worker in range(workers):
            slot = logical_slot(worker, workers, start)
            queues[worker] = [(slot, b) for b in range(local_skip(start, slot, workers), per_slot)]
        resumed = []  # torch's DataLoader: workers in turn, exhausted ones dropped
        for round_ in itertools.count():
            live = [q for q in queues.values() if len(q) > round_]
            if not live:
                break
            resumed += [queues[w][round_] for w in range(workers) if len(queues[w]) > round_]
        assert resumed == order[start:]


def test_resampled_epoch_rule():
    assert resampled_batches_per_slot(1000, batch_size=8, world_size=2, workers=3) == 21  # ceil(ceil(62.5)/3)
    assert resampled_batches_per_slot(16, batch_size=8, world_size=2, workers=1) == 1


def test_brace_and_source_expansion_counts():
    assert len(expand_sources("x/part-{000..009}.tar")[0].shards) == 10
    assert expand_sources("x/part-{000..009}.tar")[0].shards[-1] == "x/part-009.tar"
    assert len(expand_sources("a-{000..009}_{000..009}.tar")[0].shards) == 100
    sources = expand_sources("a-{0..2}.tar::b/{x,y}-{00..04}.tar", "1::3")
    assert [len(s.shards) for s in sources] == [3, 10] and [s.weight for s in sources] == [1.0, 3.0]
    assert len(expand_sources(["one.tar", "two.tar"])[0].shards) == 2
    with pytest.raises(ConfigError, match="2 sources"):
        expand_sources("a.tar::b.tar", [1.0])


def test_a_batch_larger_than_the_data_set_is_warned(tmp_path, tokenizer, caplog):
    """3 samples, batch 8: every epoch trained on 5 repeats without a word (issue 26)."""
    import logging

    import torch

    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
    from tests.data.shard_samples import write_simple_shards
    pattern, keys = write_simple_shards(str(tmp_path), [3])
    with caplog.at_level(logging.WARNING, logger="mplug_pretrain.data.reading.epoch_plan"):
        loader = build_pretrain_loader(LoaderSpec(pattern, batch_size=8, shuffle=True, rank=0, world_size=1),
                                       tokenizer, image_size=32, max_text_len=16, augment=False)
        [batch] = list(loader)
        # built again next epoch: said once
        build_pretrain_loader(LoaderSpec(pattern, batch_size=8, shuffle=True, rank=0, world_size=1, epoch=1),
                              tokenizer, image_size=32, max_text_len=16, augment=False)
    repeats = int(torch.as_tensor(batch["is_pad"]).sum())
    assert repeats == 8 - len(keys) == 5
    [record] = caplog.records
    assert f"{len(keys)} sample(s) but an epoch yields 8 rows" in record.getMessage()
    assert f": {repeats} (62%) repeat samples" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mplug_pretrain.data.reading.epoch_plan"):  # a batch the data fills
        ExactPlan(["a", "b"], [40, 40], world_size=1, workers=1, batch_size=8, shuffle=True, seed=0)
        ExactPlan(["c"], [3], world_size=1, workers=1, batch_size=8, shuffle=False, seed=0)  # evaluation
    assert not caplog.records
