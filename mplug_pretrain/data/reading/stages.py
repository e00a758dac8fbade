"""Pipeline stages: each takes an iterator and returns one (webdataset's convention), so a reader
is a flat ``wds.DataPipeline([...])`` list read top to bottom (see ``pipeline.py``).

Samples carry ``__pos__``, their position in the slot's raw stream (corrupt ones included). Batch
b of a slot is made of the raw positions [b * B, (b + 1) * B): a corrupt sample leaves a hole
that is filled with an ``is_pad`` repeat, so skipping raw samples to resume needs no decoding.
"""
from __future__ import annotations

import logging
import os
import random
import tarfile
from collections.abc import Callable, Container, Iterable, Iterator
from functools import partial

import numpy as np
import webdataset as wds

from mplug_pretrain.data.formats.image_decode import SampleError
from mplug_pretrain.data.formats.manifest import count_source
from mplug_pretrain.data.reading.decode_stats import DecodeStats
from mplug_pretrain.errors import DataError

log = logging.getLogger(__name__)


def resampled_urls(shards: tuple[str, ...], rng: random.Random) -> Iterator[dict]:
    """Endless shard URLs drawn with replacement (resampled mode)."""
    while True:
        yield {"url": rng.choice(shards)}


def url_list(shards: Iterable[str]) -> Iterator[dict]:
    return ({"url": url} for url in shards)


def _record_and_continue(errors: list[Exception], exn: Exception) -> bool:
    errors.append(exn)
    return True  # webdataset's handler protocol: True = go on


def tar_samples(urls: Iterator[dict], *, stats: DecodeStats, expected: dict[str, int] | None = None,
                count_shard_errors: bool = True) -> Iterator[dict]:
    """Samples of each shard in turn (``webdataset.tarfile_samples``). A shard that breaks off
    (truncated, unreadable) is counted once and left; the samples read before the break are kept.
    ``expected`` (exact mode) makes a shard holding more samples than its manifest says an error."""
    for item in urls:
        url = item["url"]
        errors: list[Exception] = []
        read = 0
        for sample in wds.tarfile_samples([{"url": url}], handler=partial(_record_and_continue, errors)):
            read += 1
            if expected is not None and read > expected[url]:
                source = count_source(url)
                raise DataError(f"{url}: holds more samples than the {expected[url]} {source} lists; "
                                f"correct {os.path.basename(source)} (or delete it to count the tars)")
            yield sample
        if errors and count_shard_errors:
            kind = "truncated_tar" if any(isinstance(e, (tarfile.ReadError, EOFError)) for e in errors) else "bad_tar"
            stats.add(kind)
            log.warning("%s: %s after %d samples: %s", url, kind, read, errors[0])


def keep_listed(samples: Iterator[dict], *, keep: dict[str, Container[int]]) -> Iterator[dict]:
    """Of each shard named in ``keep``, only the samples whose index in the shard is listed (a re-split epoch: the
    samples its first layout had not consumed); other shards pass whole. A shard's samples arrive together."""
    url, index = None, 0
    for sample in samples:
        if sample["__url__"] != url:
            url, index = sample["__url__"], 0
        listed = keep.get(url)
        if listed is None or index in listed:
            yield sample
        index += 1


def seeded_shuffle(buffer: int, seed: int):
    """webdataset's shuffle buffer, drawing from ``random.Random(seed)``. Its draws depend on the seed and on how
    many samples came in, never on what they hold: data/reading/resplit.py replays it on sample indices."""
    return wds.shuffle(buffer, initial=buffer, rng=random.Random(seed))


def take_every(samples: Iterator[dict], *, stride: int, offset: int) -> Iterator[dict]:
    """Raw samples i with i % stride == offset (exact mode, sample split)."""
    for i, sample in enumerate(samples):
        if i % stride == offset:
            yield sample


class SeededRandomMix(wds.RandomMix):
    """``wds.RandomMix`` drawing from an explicit ``random.Random``: the library's version uses the
    global ``random`` module, which makes the mixed order irreproducible."""

    def __init__(self, datasets: list, probs: list[float], rng: random.Random):
        super().__init__(datasets, probs, longest=False)
        self.rng = rng

    def __iter__(self) -> Iterator[dict]:
        sources = [iter(d) for d in self.datasets]
        cumulative = np.cumsum(np.asarray(self.probs, dtype=np.float64) / float(np.sum(self.probs)))
        while True:
            i = min(int(np.searchsorted(cumulative, self.rng.random(), side="right")), len(sources) - 1)
            try:
                yield next(sources[i])
            except StopIteration:
                return


def number_positions(samples: Iterator[dict], *, stats: DecodeStats, limit: int | None = None,
                     expected: int | None = None) -> Iterator[dict]:
    """Tag ``__pos__``; stop after ``limit`` samples; count ``missing_samples`` short of ``expected``."""
    count = 0
    for sample in samples:
        if limit is not None and count >= limit:
            return
        sample["__pos__"] = count
        count += 1
        yield sample
    if expected is not None and count < expected:
        stats.add("missing_samples", expected - count)


def skip_positions(samples: Iterator[dict], *, first: int) -> Iterator[dict]:
    """Drop raw samples before position ``first`` (resume), without decoding them."""
    for sample in samples:
        if sample["__pos__"] >= first:
            yield sample


def decode_samples(samples: Iterator[dict], *, decode: Callable[[dict], dict], stats: DecodeStats) -> Iterator[dict]:
    """``decode(sample)`` per sample (keeping ``__pos__``); a ``SampleError`` is counted under its
    kind and skipped. Any other exception is one sample's problem too (a field of a type no check
    foresaw): counted as ``decode_error``, logged as a warning, skipped; one sample never ends a run."""
    for sample in samples:
        try:
            out = decode(sample)
        except SampleError as err:
            stats.add(err.kind)
            log.debug("%s %s: skipped (%s: %s)", sample.get("__url__"), sample.get("__key__"), err.kind, err)
            continue
        except Exception as err:  # noqa: BLE001 (per-sample isolation is the point)
            stats.add("decode_error")
            log.warning("%s %s: skipped (decode_error: %s: %s)", sample.get("__url__"), sample.get("__key__"),
                        type(err).__name__, err)
            continue
        stats.add("decoded")
        out["__pos__"] = sample["__pos__"]
        yield out


def batch_by_position(samples: Iterator[dict], *, batch_size: int, first_batch: int, num_batches: int,
                      collate: Callable[[list[dict], list[bool]], dict], blank: Callable[[], dict],
                      stats: DecodeStats) -> Iterator[dict]:
    """Batches ``first_batch .. num_batches - 1`` of this slot, each exactly ``batch_size`` long.
    Holes (corrupt samples, the end of the data) are filled with repeats of real samples, or
    ``blank()`` when the slot has none, flagged ``is_pad``. Each batch carries ``__stats__``."""
    recent: list[dict] = []  # real samples to repeat as padding

    def padded(real: list[dict]) -> tuple[list[dict], int]:
        pool = (recent + real)[-batch_size:]
        fillers = [pool[i % len(pool)] if pool else blank() for i in range(batch_size - len(real))]
        return real + fillers, len(fillers)

    def emit(real: list[dict]) -> dict:
        full, n_fill = padded(real)
        try:
            batch = collate(full, [False] * len(real) + [True] * n_fill)
        except Exception:  # noqa: BLE001 (drop the samples that cannot be batched, keep the others)
            real = _collatable(real, collate, stats)
            full, n_fill = padded(real)
            batch = collate(full, [False] * len(real) + [True] * n_fill)
        recent.extend(real)
        del recent[:-batch_size]
        stats.add("padded", n_fill)
        batch["__stats__"] = stats.take_delta()
        return batch

    current, pending = first_batch, []
    for sample in samples:
        index = sample["__pos__"] // batch_size
        if index >= num_batches:
            raise DataError(f"sample {sample.get('__key__')} at position {sample['__pos__']} lies beyond the "
                            f"{num_batches} batches planned for this slot")
        while index > current:
            yield emit(pending)
            current, pending = current + 1, []
        pending.append(sample)
    while current < num_batches:
        yield emit(pending)
        current, pending = current + 1, []


def _collatable(samples: list[dict], collate: Callable, stats: DecodeStats) -> list[dict]:
    """The samples ``collate`` accepts one by one; each refused one is counted as ``collate_error``."""
    kept = []
    for sample in samples:
        try:
            collate([sample], [False])
        except Exception as err:  # noqa: BLE001
            stats.add("collate_error")
            log.warning("%s: skipped (collate_error: %s: %s)", sample.get("__key__"), type(err).__name__, err)
            continue
        kept.append(sample)
    return kept
