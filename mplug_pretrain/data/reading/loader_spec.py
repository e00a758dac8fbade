"""``LoaderSpec``: what a ``ShardLoader`` reads and in which order, one frozen value passed to the builders of
``data/reading/pipeline.py`` instead of a dozen keyword arguments.

The other half of a loader is its sample format (``data/formats/samples.py``: decode, transform, tokenize, collate),
which the public builders make from an image size, a text length and a tokenizer.

    urls               brace pattern(s) of .tar shards; several sources separated by '::'
    batch_size         per rank
    num_workers        DataLoader processes (0: in the main process, planned as one worker)
    mode               "exact" (every sample once per epoch) | "resampled" (shards drawn with replacement)
    seed, shuffle      the seed of every random choice; shuffle the samples (a shuffle buffer per worker)
    samples_per_epoch  resampled: the epoch's sample budget over all ranks (default: the manifest totals)
    weights            resampled: one weight per '::' source
    epoch, start_batch where the walk starts (resume: the batches per rank of this epoch already consumed)
    resplit_from       resume on another layout: the ``ResplitPoint`` (world size, num_workers, batch size,
                       batches per rank) of the layout that consumed the epoch's first batches; this loader yields
                       the rest of that epoch re-split over its own ranks and workers (data/reading/resplit.py),
                       then ordinary epochs. None, or the same layout: the ordinary resume
    rank, world_size   this process's place; None: torch.distributed, else RANK / WORLD_SIZE, else (0, 1)
    max_image_pixels   images over this many pixels are skipped before decoding (``too_many_pixels``)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from mplug_pretrain.data.formats.image_decode import DEFAULT_MAX_IMAGE_PIXELS
from mplug_pretrain.errors import ConfigError

MODES = ("exact", "resampled")


@dataclass(frozen=True)
class ResplitPoint:
    """Where an epoch was left on another layout: that run's world size, num_workers and per-rank batch size, and
    the batches per rank it consumed of epoch ``LoaderSpec.epoch`` (None: ``LoaderSpec.start_batch``)."""
    world_size: int
    num_workers: int
    batch_size: int
    batches: int | None = None

    @property
    def workers(self) -> int:
        return max(self.num_workers, 1)

    @property
    def layout(self) -> tuple[int, int, int]:
        """(world size, worker slots per rank, batch size): what fixes an epoch's plan, besides seed and shards."""
        return self.world_size, self.workers, self.batch_size


@dataclass(frozen=True)
class LoaderSpec:
    urls: str
    batch_size: int
    num_workers: int = 0
    mode: str = "exact"
    seed: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 1000
    samples_per_epoch: int | None = None
    weights: Sequence[float] | None = None
    epoch: int = 0
    start_batch: int = 0
    rank: int | None = None
    world_size: int | None = None
    pin_memory: bool = False
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    resplit_from: ResplitPoint | tuple[int, ...] | None = None  # a tuple: ResplitPoint's fields in order

    def __post_init__(self):
        self._check_resplit()
        if self.mode not in MODES:
            raise ConfigError(f"data.mode: {self.mode!r} not in {MODES}")
        if self.batch_size < 1 or self.num_workers < 0 or self.shuffle_buffer < 1:
            raise ConfigError(f"data: batch_size {self.batch_size}, num_workers {self.num_workers}, shuffle_buffer "
                              f"{self.shuffle_buffer}: need >= 1, >= 0, >= 1")
        if self.max_image_pixels < 1:
            raise ConfigError(f"data.max_image_pixels: {self.max_image_pixels} must be >= 1")
        if self.mode == "exact" and self.weights is not None:
            raise ConfigError("data.train_weights: source weights need data.mode=resampled (exact mode reads every "
                              "sample once)")
        if self.mode == "exact" and self.samples_per_epoch is not None:
            raise ConfigError("data.samples_per_epoch: only used with data.mode=resampled")

    def _check_resplit(self) -> None:
        point = self.resplit_from
        if point is None:
            return
        if not isinstance(point, ResplitPoint):
            if not 3 <= len(point) <= 4:
                raise ConfigError(f"resplit_from: {point!r}: need (world_size, num_workers, batch_size[, batches])")
            point = ResplitPoint(*point)
        if point.batches is None:
            point = replace(point, batches=self.start_batch)
        object.__setattr__(self, "resplit_from", point)  # frozen: normalised once, here
        if point.world_size < 1 or point.num_workers < 0 or point.batch_size < 1 or point.batches < 0:
            raise ConfigError(f"resplit_from: {point}: need world_size >= 1, num_workers >= 0, batch_size >= 1, "
                              "batches >= 0")
        if self.start_batch < point.batches:
            raise ConfigError(f"start_batch {self.start_batch}: the re-split epoch starts after the "
                              f"{point.batches} batches per rank its first layout consumed (start_batch counts them)")

    @classmethod
    def evaluation(cls, urls: str, batch_size: int, num_workers: int = 0, rank: int | None = None,
                   world_size: int | None = None) -> LoaderSpec:
        """Every sample once, in shard order (this rank's share; padding rows flagged is_pad)."""
        return cls(urls, batch_size, num_workers, mode="exact", shuffle=False, rank=rank, world_size=world_size)

    @property
    def workers(self) -> int:
        """The worker slots the epoch is planned for (num_workers 0 still reads as one slot)."""
        return max(self.num_workers, 1)
