"""WebDataset reader pipelines and the loader builders the trainer calls.

One worker's stream, top to bottom (``ShardStream.__iter__``):

  exact:      this slot's shards (epoch_plan) -> tar samples (corrupt shards counted)
              -> [every S-th raw sample, sample split] -> [shuffle buffer, seeded]
              -> number raw positions (count missing)
  resampled:  per source: shards drawn with replacement -> tar samples -> shuffle buffer;
              sources mixed by weight (SeededRandomMix) -> number raw positions: T * B of them,
              webdataset's ``with_epoch(T)`` per worker with T from the manifest totals
  then:       skip positions before the resume point -> decode + transform (corrupt samples
              counted) -> batch by position, pads flagged is_pad -> collate (tokenize)

Rank and slot come from explicit arguments, else the process group (utils/process_group.py), else
RANK/WORLD_SIZE (a loader built before the group exists), and the DataLoader worker id (see
``epoch_plan`` for the split and the resume rule). Every random choice
draws from a generator seeded by (seed, epoch, slot), so an epoch's batches are a function of
(shards, seed, epoch, world_size, num_workers, batch_size).
"""
from __future__ import annotations

import json
import os
import random
from functools import partial

import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from mplug_pretrain.data.decode_stats import DecodeStats
from mplug_pretrain.data.epoch_plan import (
    ExactPlan,
    derive_seed,
    local_skip,
    logical_slot,
    resampled_batches_per_slot,
)
from mplug_pretrain.data.formats import CaptionEvalFormat, ImageTextFormat, VideoFormat, VQAFormat
from mplug_pretrain.data.loader import ShardLoader
from mplug_pretrain.data.manifest import dataset_entry, local_path, shard_sample_counts
from mplug_pretrain.data.stages import (
    SeededRandomMix,
    batch_by_position,
    decode_samples,
    number_positions,
    resampled_urls,
    skip_positions,
    take_every,
    tar_samples,
    url_list,
)
from mplug_pretrain.data.transforms import build_eval_transform, build_train_transform
from mplug_pretrain.data.urls import ShardSource, all_shards, expand_sources
from mplug_pretrain.errors import ConfigError, DataError
from mplug_pretrain.utils import process_group

MODES = ("exact", "resampled")


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else the initialized process group's, else RANK/WORLD_SIZE, else (0, 1)."""
    if rank is None or world_size is None:
        if process_group.is_distributed():
            rank, world_size = process_group.rank(), process_group.world_size()
        else:
            rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} / world_size {world_size}: need 0 <= rank < world_size")
    return rank, world_size


class ShardStream(IterableDataset):
    """The per-worker stream of ready batches for one rank (see the module docstring)."""

    def __init__(self, sources: list[ShardSource], fmt, *, batch_size: int, mode: str, seed: int, rank: int,
                 world_size: int, workers: int, shuffle: bool, shuffle_buffer: int, plan: ExactPlan | None,
                 batches_per_slot: int, epoch: int = 0, start_batch: int = 0):
        super().__init__()
        self.sources, self.fmt, self.batch_size, self.mode = sources, fmt, batch_size, mode
        self.seed, self.rank, self.world_size, self.workers = seed, rank, world_size, workers
        self.shuffle, self.shuffle_buffer, self.plan = shuffle, shuffle_buffer, plan
        self.batches_per_slot, self.epoch, self.start_batch = batches_per_slot, epoch, start_batch

    def __iter__(self):
        info = get_worker_info()
        running = info.num_workers if info else 1
        if running != self.workers:
            raise RuntimeError(f"ShardStream planned for {self.workers} worker(s) runs in {running}; "
                               "iterate it through its ShardLoader")
        slot = logical_slot(info.id if info else 0, self.workers, self.start_batch)
        global_slot = self.rank * self.workers + slot
        skip = local_skip(self.start_batch, slot, self.workers)
        slot_seed = derive_seed(self.seed, self.epoch, global_slot)
        stats = DecodeStats()
        raw = (self._exact_stages(global_slot, slot_seed, stats) if self.mode == "exact"
               else self._resampled_stages(slot_seed, stats))
        return iter(wds.DataPipeline(raw + [
            partial(skip_positions, first=skip * self.batch_size),
            partial(decode_samples, decode=partial(self.fmt.decode, seed=slot_seed), stats=stats),
            partial(batch_by_position, batch_size=self.batch_size, first_batch=skip,
                    num_batches=self.batches_per_slot, collate=self.fmt.collate, blank=self.fmt.blank, stats=stats),
        ]))

    def _shuffle_stage(self, seed: int):
        return wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=random.Random(seed))

    def _exact_stages(self, global_slot: int, slot_seed: int, stats: DecodeStats) -> list:
        assignment = self.plan.assignment(self.epoch, global_slot)
        counts = dict(zip(self.plan.shards, self.plan.counts))
        stages = [partial(url_list, assignment.shards),
                  # with a sample split every slot reads every shard: slot 0 alone reports broken shards
                  partial(tar_samples, stats=stats, expected=counts,
                          count_shard_errors=assignment.stride == 1 or global_slot == 0)]
        if assignment.stride > 1:
            stages.append(partial(take_every, stride=assignment.stride, offset=assignment.offset))
        if self.shuffle:
            stages.append(self._shuffle_stage(derive_seed(slot_seed, "samples")))
        stages.append(partial(number_positions, stats=stats, expected=assignment.expected))
        return stages

    def _resampled_stages(self, slot_seed: int, stats: DecodeStats) -> list:
        per_source = [wds.DataPipeline(partial(resampled_urls, src.shards, random.Random(derive_seed(slot_seed, i))),
                                       partial(tar_samples, stats=stats),
                                       self._shuffle_stage(derive_seed(slot_seed, "samples", i)) if self.shuffle else None)
                      for i, src in enumerate(self.sources)]
        mixed = (per_source[0] if len(per_source) == 1 else
                 SeededRandomMix(per_source, [s.weight for s in self.sources], random.Random(derive_seed(slot_seed, "mix"))))
        return [mixed, partial(number_positions, stats=stats, limit=self.batches_per_slot * self.batch_size)]


def _check_local_shards(shards: list[str]) -> None:
    missing = [u for u in shards if local_path(u) is not None and not os.path.exists(local_path(u))]
    if missing:
        raise DataError(f"{len(missing)} of {len(shards)} shard file(s) do not exist, e.g. {missing[0]}")


def build_loader(urls, fmt, *, batch_size: int, num_workers: int = 0, mode: str = "exact", seed: int = 0,
                 epoch: int = 0, start_batch: int = 0, shuffle: bool = True, rank: int | None = None,
                 world_size: int | None = None, samples_per_epoch: int | None = None, weights=None,
                 shuffle_buffer: int = 1000, pin_memory: bool = False, answer_list: list[str] | None = None) -> ShardLoader:
    """Any sample format; the public builders below fix the format and transforms."""
    if mode not in MODES:
        raise ConfigError(f"data.mode: {mode!r} not in {MODES}")
    if batch_size < 1 or num_workers < 0 or shuffle_buffer < 1:
        raise ConfigError(f"data: batch_size {batch_size}, num_workers {num_workers}, shuffle_buffer "
                          f"{shuffle_buffer}: need >= 1, >= 0, >= 1")
    if mode == "exact" and weights is not None:
        raise ConfigError("data.train_weights: source weights need data.mode=resampled (exact mode reads every sample once)")
    if mode == "exact" and samples_per_epoch is not None:
        raise ConfigError("data.samples_per_epoch: only used with data.mode=resampled")
    rank, world_size = _rank_and_world_size(rank, world_size)
    sources = expand_sources(urls, weights)
    shards = all_shards(sources)
    _check_local_shards(shards)
    workers = max(num_workers, 1)
    plan = None
    if mode == "exact":
        plan = ExactPlan(shards, shard_sample_counts(shards), world_size=world_size, workers=workers,
                         batch_size=batch_size, shuffle=shuffle, seed=seed)
        batches_per_slot = plan.batches_per_slot
    else:
        total = samples_per_epoch if samples_per_epoch is not None else sum(shard_sample_counts(shards))
        batches_per_slot = resampled_batches_per_slot(total, batch_size=batch_size, world_size=world_size,
                                                      workers=workers)
    stream = ShardStream(sources, fmt, batch_size=batch_size, mode=mode, seed=seed, rank=rank,
                         world_size=world_size, workers=workers, shuffle=shuffle, shuffle_buffer=shuffle_buffer,
                         plan=plan, batches_per_slot=batches_per_slot, epoch=epoch, start_batch=start_batch)
    return ShardLoader(stream, num_workers=num_workers, pin_memory=pin_memory, answer_list=answer_list)


def build_pretrain_loader(urls, *, batch_size: int, image_size: int, max_text_len: int, tokenizer,
                          num_workers: int = 0, mode: str = "exact", seed: int = 0, epoch: int = 0,
                          start_batch: int = 0, train: bool = True, rank: int | None = None,
                          world_size: int | None = None, samples_per_epoch: int | None = None, weights=None,
                          shuffle_buffer: int = 1000, pin_memory: bool = False) -> ShardLoader:
    """Image-text batches (pretraining, caption fine-tuning). ``train``: augment + shuffle."""
    transform = build_train_transform(image_size) if train else build_eval_transform(image_size)
    fmt = ImageTextFormat(transform, tokenizer, max_text_len, image_size)
    return build_loader(urls, fmt, batch_size=batch_size, num_workers=num_workers, mode=mode, seed=seed,
                        epoch=epoch, start_batch=start_batch, shuffle=train, rank=rank, world_size=world_size,
                        samples_per_epoch=samples_per_epoch, weights=weights, shuffle_buffer=shuffle_buffer,
                        pin_memory=pin_memory)


def load_answer_list(urls) -> list[str] | None:
    """The answer list a VQA writer named in the manifest of the first shard's folder, if any."""
    first = all_shards(expand_sources(urls))[0]
    entry = dataset_entry(first)
    if not entry or not entry.get("answer_list"):
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(local_path(first))), entry["answer_list"])
    with open(path) as f:
        return json.load(f)


def build_vqa_loader(urls, *, batch_size: int, image_size: int, max_text_len: int, tokenizer,
                     num_workers: int = 0, mode: str = "exact", seed: int = 0, epoch: int = 0,
                     start_batch: int = 0, train: bool = True, rank: int | None = None,
                     world_size: int | None = None, samples_per_epoch: int | None = None, weights=None,
                     shuffle_buffer: int = 1000, pin_memory: bool = False) -> ShardLoader:
    """VQA batches; ``loader.answer_list`` is the shards' answer list (None when not written)."""
    transform = build_train_transform(image_size) if train else build_eval_transform(image_size)
    fmt = VQAFormat(transform, tokenizer, max_text_len, image_size)
    return build_loader(urls, fmt, batch_size=batch_size, num_workers=num_workers, mode=mode, seed=seed,
                        epoch=epoch, start_batch=start_batch, shuffle=train, rank=rank, world_size=world_size,
                        samples_per_epoch=samples_per_epoch, weights=weights, shuffle_buffer=shuffle_buffer,
                        pin_memory=pin_memory, answer_list=load_answer_list(urls))


def build_caption_eval_loader(urls, *, batch_size: int, image_size: int, num_workers: int = 0,
                              rank: int | None = None, world_size: int | None = None) -> ShardLoader:
    """Evaluation images with their reference captions; exact epoch, no shuffle, pads flagged."""
    fmt = CaptionEvalFormat(build_eval_transform(image_size), image_size)
    return build_loader(urls, fmt, batch_size=batch_size, num_workers=num_workers, mode="exact",
                        shuffle=False, rank=rank, world_size=world_size)


def build_video_loader(urls, *, batch_size: int, num_workers: int = 0, rank: int | None = None,
                       world_size: int | None = None, num_frames: int | None = None, image_size: int | None = None,
                       frame_mode: str = "uniform", backend: str = "auto") -> ShardLoader:
    """Raw video bytes + captions/QA (exact, no shuffle). With ``num_frames`` (and ``image_size``)
    also ``video`` float32 [B, N, 3, H, W] decoded by ``data.video_frames.decode_frames``."""
    if num_frames is not None and image_size is None:
        raise ConfigError("eval.num_frames: decoding frames needs image_size too")
    transform = build_eval_transform(image_size) if num_frames is not None else None
    fmt = VideoFormat(num_frames, frame_mode, transform, image_size, backend)
    return build_loader(urls, fmt, batch_size=batch_size, num_workers=num_workers, mode="exact",
                        shuffle=False, rank=rank, world_size=world_size)
