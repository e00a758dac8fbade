"""The rest of an interrupted epoch re-split over another layout: resuming on other ranks or workers.

An epoch's order is a function of (shards, seed, epoch, world size, workers, batch size) (epoch_plan.py), so what
a layout had consumed when it stopped is recomputed, not stored: its slot g had yielded the first
``local_skip(batches, g % W, W) * B`` positions of its stream (pad rows beyond the stream's end are no samples).
The replay walks each old slot's stream on sample *indices*, (shard, index in the shard) laid out from the
manifest counts, taken every S-th (sample split), through the same seeded shuffle buffer
(``stages.seeded_shuffle``: its draws depend only on how many samples came in). It reads no shard: the cost is one
shuffle draw per consumed sample, on every rank (about 2 s per million consumed samples on one core), and a bit
per sample of each shard read in part.

What is left is then: the shards no old slot reached (whole), the shards it read in part (their unread indices
listed) and nothing of the rest. An ``ExactPlan`` over the remaining counts and the new layout splits it as any
epoch (shard split in longest-first balanced groups, which keeps each shard on one slot, or sample split; T'
batches per slot on every rank, pads as usual), and each new slot reads its shards keeping only the listed
indices (``stages.keep_listed``, before decoding: a shard read in part is read whole once more). Resampled mode has nothing to re-split: the re-split epoch is the rest of its
sample budget (samples_per_epoch minus the rows consumed), drawn afresh on the new layout.

Limits. Exact when each shard holds the samples its manifest lists (ExactPlan's premise too); a shard holding
fewer (truncated) shifts the replay of the slots that read past it, so samples near the interruption point may be
seen twice or not at all in the re-split epoch. The consuming run's seed, shuffle and shuffle_buffer must be this
spec's (they are the run's config). Another change of layout inside a re-split epoch is not supported: finish the
epoch on the layout it was re-split to.
"""
from __future__ import annotations

import bisect
import itertools
import logging
from dataclasses import dataclass, field

import numpy as np

from mplug_pretrain.data.reading.epoch_plan import (
    ExactPlan,
    derive_seed,
    local_skip,
    resampled_batches_per_slot,
    slot_seed,
)
from mplug_pretrain.data.reading.loader_spec import ResplitPoint
from mplug_pretrain.data.reading.stages import seeded_shuffle
from mplug_pretrain.errors import ConfigError

log = logging.getLogger(__name__)


class IndexMask:
    """A set of indices into one shard, one bit per sample: a partly read shard may hold millions, and every
    DataLoader worker gets a copy. ``present``: bool [samples in the shard]."""

    def __init__(self, present: np.ndarray):
        self.bits = np.packbits(present, bitorder="little").tobytes()
        self.size, self.count = len(present), int(present.sum())

    def __contains__(self, index: int) -> bool:
        return 0 <= index < self.size and bool(self.bits[index >> 3] >> (index & 7) & 1)

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return (i for i in range(self.size) if i in self)


@dataclass(frozen=True)
class Remainder:
    """Epoch ``epoch`` after ``first_batch`` batches per rank on another layout, re-split over this one. Its
    batches are numbered on from ``first_batch``: the epoch has ``first_batch + workers * batches_per_slot``."""
    epoch: int
    first_batch: int
    batches_per_slot: int
    plan: ExactPlan | None = None  # exact mode: the plan of the remaining samples (None: none remain)
    keep: dict[str, IndexMask] = field(default_factory=dict)  # partly read shard -> indices still to read


def _slot_segments(plan: ExactPlan, epoch: int, global_slot: int) -> list[tuple[int, range]]:
    """(shard index, the indices in that shard the slot reads, in order) for each shard of the slot's stream."""
    index = {url: i for i, url in enumerate(plan.shards)}
    assignment = plan.assignment(epoch, global_slot)
    segments, raw = [], 0
    for url in assignment.shards:
        shard = index[url]
        picked = range((assignment.offset - raw) % assignment.stride, plan.counts[shard], assignment.stride)
        if picked:
            segments.append((shard, picked))
        raw += plan.counts[shard]
    return segments


def _replay(total: int, positions: int, shuffle_seed: int | None, buffer: int) -> tuple[int, set[int]]:
    """A slot stream of ``total`` items that yielded its first ``positions``: -> (how many items it had read,
    those read but still in its shuffle buffer)."""
    if shuffle_seed is None or positions == 0:
        return min(positions, total), set()
    pending: set[int] = set()

    def items():
        for t in range(total):
            pending.add(t)
            yield t

    for t in itertools.islice(seeded_shuffle(buffer, shuffle_seed)(items()), positions):
        pending.discard(t)
    return min(positions, total) + len(pending), pending


def remaining_samples(old: ExactPlan, epoch: int, batches: int, shuffle_buffer: int
                      ) -> tuple[list[int], dict[int, IndexMask]]:
    """What ``old`` had not yielded of ``epoch`` after ``batches`` batches per rank: -> (remaining count per shard,
    the remaining indices of each shard it read in part)."""
    pieces: list[list[tuple[range, set[int]]]] = [[] for _ in old.shards]  # per shard: (indices read, not yielded)
    for g in range(old.num_slots):
        segments = _slot_segments(old, epoch, g)
        starts = list(itertools.accumulate((len(picked) for _, picked in segments), initial=0))
        positions = local_skip(batches, g % old.workers, old.workers) * old.batch_size
        seed = derive_seed(slot_seed(old.seed, epoch, g), "samples") if old.shuffle else None
        read, pending = _replay(starts[-1], positions, seed, shuffle_buffer)
        unyielded: dict[int, set[int]] = {}
        for t in pending:
            i = bisect.bisect_right(starts, t) - 1
            unyielded.setdefault(i, set()).add(segments[i][1][t - starts[i]])
        for i, (shard, picked) in enumerate(segments):
            if starts[i] < read:
                pieces[shard].append((picked[:read - starts[i]], unyielded.get(i, set())))
    left, keep = [], {}
    for shard, read_pieces in enumerate(pieces):
        consumed = sum(len(r) - len(p) for r, p in read_pieces)
        left.append(old.counts[shard] - consumed)
        if 0 < consumed < old.counts[shard]:
            present = np.ones(old.counts[shard], dtype=bool)
            for indices, unyielded in read_pieces:
                present[indices.start:indices.stop:indices.step] = False
                present[list(unyielded)] = True
            keep[shard] = IndexMask(present)
    return left, keep


def _check_position(point: ResplitPoint, num_batches: int) -> None:
    if point.batches > num_batches:
        raise ConfigError(f"resplit_from: {point.batches} batches per rank consumed, but the epoch of "
                          f"{point.world_size} rank(s) x {point.workers} worker(s) x batch {point.batch_size} has "
                          f"{num_batches}")


def exact_remainder(plan: ExactPlan, point: ResplitPoint, *, epoch: int, shuffle_buffer: int) -> Remainder:
    """The samples of ``epoch`` the layout of ``point`` had not yielded, planned over ``plan``'s layout (the same
    shards, counts, seed and shuffle)."""
    old = ExactPlan(plan.shards, plan.counts, world_size=point.world_size, workers=point.workers,
                    batch_size=point.batch_size, shuffle=plan.shuffle, seed=plan.seed, warn=False)
    _check_position(point, old.num_batches)
    left, keep = remaining_samples(old, epoch, point.batches, shuffle_buffer)
    shards = [s for s in range(len(plan.shards)) if left[s]]
    rest = None
    if shards:  # its filler is the end of an epoch, not a batch too large for the data: no warning
        rest = ExactPlan([plan.shards[s] for s in shards], [left[s] for s in shards], world_size=plan.world_size,
                         workers=plan.workers, batch_size=plan.batch_size, shuffle=plan.shuffle, seed=plan.seed,
                         warn=False)
    _log(epoch, point, sum(left), plan.workers * rest.batches_per_slot if rest else 0)
    return Remainder(epoch, point.batches, rest.batches_per_slot if rest else 0, rest,
                     {plan.shards[s]: indices for s, indices in keep.items()})


def resampled_remainder(budget: int, point: ResplitPoint, *, epoch: int, batch_size: int, world_size: int,
                        workers: int) -> Remainder:
    """The rest of a resampled epoch's ``budget`` samples after the rows ``point`` consumed, on this layout."""
    _check_position(point, point.workers * resampled_batches_per_slot(
        budget, batch_size=point.batch_size, world_size=point.world_size, workers=point.workers))
    left = budget - point.batches * point.world_size * point.batch_size
    per_slot = (resampled_batches_per_slot(left, batch_size=batch_size, world_size=world_size, workers=workers)
                if left > 0 else 0)
    _log(epoch, point, max(left, 0), workers * per_slot)
    return Remainder(epoch, point.batches, per_slot)


def _log(epoch: int, point: ResplitPoint, samples: int, batches: int) -> None:
    log.info("data: epoch %d re-split after %d batch(es) per rank on %d rank(s) x %d worker(s) x batch %d: %d "
             "sample(s) left, %d batch(es) per rank here", epoch, point.batches, point.world_size, point.workers,
             point.batch_size, samples, batches)
