"""Epoch accounting: what each (rank, worker) slot reads, how many batches every rank yields, and
where a resumed loader starts.

Slots. With W = max(num_workers, 1) workers per rank there are S = world_size * W slots; global
slot g = rank * W + s for logical worker slot s. Every slot yields exactly T full batches of B
samples, so every rank yields W * T batches. Real samples that do not fill the last batches are
topped up with repeats flagged ``is_pad`` (evaluation drops them).

Exact mode (every real sample once per epoch across all slots):
  * shard split: shards go to S groups by longest-processing-time (largest first, onto the least
    loaded group; fixed for the run, so T is the same every epoch); each epoch permutes the groups
    over slots and shuffles the order inside each group (seed, epoch); T = ceil(max load / B).
  * sample split, used when there are fewer shards than slots or shard split would need over 10%
    more batches: every slot reads all shards in the same (seeded, per-epoch) order and keeps raw
    samples i with i % S == g; T = ceil(ceil(N / S) / B).
Resampled mode: T = ceil(ceil(samples_per_epoch / (B * world_size)) / W)  (open_clip's rule).

Order and resume. A rank's batch k comes from logical slot k % W (its local batch k // W): torch's
DataLoader takes batches from its workers round-robin. A loader resumed at ``start_batch`` = k lets
DataLoader worker i play logical slot (i + k) % W and skip that slot's first ``local_skip(k, s, W)``
batches, so it yields exactly batches k, k+1, ... of the uninterrupted epoch. On another layout (world size,
workers or batch size), resplit.py re-splits the samples the first layout had not yielded.
"""
from __future__ import annotations

import hashlib
import logging
import math
import random
from dataclasses import dataclass

from mplug_pretrain.errors import DataError

log = logging.getLogger(__name__)
SHARD_SPLIT_SLACK = 1.1  # shard split may cost at most 10% more batches than sample split
_WARNED: set = set()  # (shards, rows) already warned about


def derive_seed(*parts) -> int:
    """A stable 63-bit seed from any printable parts (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def slot_seed(seed: int, epoch: int, global_slot: int) -> int:
    """The seed of every random choice of one slot's stream in one epoch."""
    return derive_seed(seed, epoch, global_slot)


@dataclass(frozen=True)
class SlotAssignment:
    shards: tuple[str, ...]  # read order this epoch
    expected: int  # real samples this slot yields
    stride: int = 1  # keep raw sample i iff i % stride == offset
    offset: int = 0


class ExactPlan:
    """Deterministic exact-epoch plan from shard sample counts (identical on every rank)."""

    def __init__(self, shards: list[str], counts: list[int], *, world_size: int, workers: int, batch_size: int,
                 shuffle: bool, seed: int, warn: bool = True):
        if len(shards) != len(counts):
            raise ValueError("one count per shard")
        self.shards, self.counts = list(shards), list(counts)
        self.total = sum(counts)
        if self.total == 0:
            raise DataError(f"no samples in {len(shards)} shard(s) (first: {shards[:1]})")
        self.world_size, self.workers, self.batch_size = world_size, workers, batch_size
        self.num_slots = world_size * workers
        self.shuffle, self.seed = shuffle, seed
        self.groups = self._balanced_groups()
        shard_batches = math.ceil(max(sum(counts[i] for i in g) for g in self.groups) / batch_size)
        sample_batches = math.ceil(math.ceil(self.total / self.num_slots) / batch_size)
        self.split = ("shard" if len(shards) >= self.num_slots and shard_batches <= SHARD_SPLIT_SLACK * sample_batches
                      else "sample")
        self.batches_per_slot = shard_batches if self.split == "shard" else sample_batches
        if shuffle and warn:  # training (evaluation reads in order and drops the filler)
            self._warn_filler()

    def _warn_filler(self) -> None:
        """A batch larger than the data set (or than a worker's share of it) is topped up with repeats: say so
        (once per process and layout; loaders are rebuilt every epoch) when they are a quarter or more of the
        rows an epoch yields."""
        rows = self.num_batches * self.world_size * self.batch_size
        filler, key = rows - self.total, (tuple(self.shards), rows)
        if filler * 4 >= rows and key not in _WARNED:
            _WARNED.add(key)
            log.warning("data: %d sample(s) but an epoch yields %d rows (%d batch(es) of %d per rank, %d rank(s), "
                        "%d worker(s) each filling whole batches): %d (%.0f%%) repeat samples (flagged is_pad). "
                        "Lower the batch size or the loader workers, or add data", self.total, rows,
                        self.num_batches, self.batch_size, self.world_size, self.workers, filler, 100.0 * filler / rows)

    def _balanced_groups(self) -> list[list[int]]:
        loads = [0] * self.num_slots
        groups: list[list[int]] = [[] for _ in range(self.num_slots)]
        for i in sorted(range(len(self.shards)), key=lambda i: (-self.counts[i], i)):
            g = loads.index(min(loads))
            groups[g].append(i)
            loads[g] += self.counts[i]
        return [sorted(g) for g in groups]

    @property
    def num_batches(self) -> int:
        """Batches per rank per epoch."""
        return self.workers * self.batches_per_slot

    def assignment(self, epoch: int, global_slot: int) -> SlotAssignment:
        rng = random.Random(derive_seed(self.seed, epoch, "exact-plan"))
        if self.split == "sample":
            order = list(range(len(self.shards)))
            if self.shuffle:
                rng.shuffle(order)
            q, r = divmod(self.total, self.num_slots)
            return SlotAssignment(tuple(self.shards[i] for i in order), q + (global_slot < r),
                                  stride=self.num_slots, offset=global_slot)
        groups = [list(g) for g in self.groups]
        if self.shuffle:
            rng.shuffle(groups)
            for g in groups:
                rng.shuffle(g)
        mine = groups[global_slot]
        return SlotAssignment(tuple(self.shards[i] for i in mine), sum(self.counts[i] for i in mine))


def resampled_batches_per_slot(samples_per_epoch: int, *, batch_size: int, world_size: int, workers: int) -> int:
    if samples_per_epoch < 1:
        raise DataError(f"samples_per_epoch: {samples_per_epoch} must be >= 1")
    return math.ceil(math.ceil(samples_per_epoch / (batch_size * world_size)) / workers)


def logical_slot(worker_id: int, workers: int, start_batch: int) -> int:
    return (worker_id + start_batch) % workers


def local_skip(start_batch: int, slot: int, workers: int) -> int:
    """How many of the first ``start_batch`` rank batches came from logical slot ``slot``."""
    return max(0, -(-(start_batch - slot) // workers))
