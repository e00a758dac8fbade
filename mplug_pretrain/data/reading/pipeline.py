"""WebDataset reader pipelines and the loader builders the trainer calls: ``build_*_loader(spec, ...)`` with
a ``LoaderSpec`` (data/reading/loader_spec.py: shards, batch size, workers, walk, position) and what the sample
format needs (image size, text length, tokenizer).

One worker's stream, top to bottom (``ShardStream.__iter__``):

  exact:      this slot's shards (epoch_plan) -> tar samples (corrupt shards counted)
              -> [every S-th raw sample, sample split] -> [shuffle buffer, seeded]
              -> number raw positions (count missing)
  re-split:   (the epoch ``LoaderSpec.resplit_from`` names, resumed on another layout: resplit.py) the same,
              over a plan of the samples the old layout had not consumed, keeping only those of its partly
              read shards after tar samples; resampled: the rest of the budget, drawn afresh
  resampled:  per source: shards drawn with replacement -> tar samples -> shuffle buffer;
              sources mixed by weight (SeededRandomMix) -> number raw positions: T * B of them,
              webdataset's ``with_epoch(T)`` per worker with T from the manifest totals
  then:       skip positions before the resume point -> decode + transform (corrupt samples
              counted) -> batch by position, pads flagged is_pad -> collate (tokenize)

Rank and slot come from the spec, else the process group (utils/process_group.py), else RANK/WORLD_SIZE (a
loader built before the group exists), and the DataLoader worker id (see ``epoch_plan`` for the split and the
resume rule). Every random choice
draws from a generator seeded by (seed, epoch, slot), so an epoch's batches are a function of
(shards, seed, epoch, world_size, num_workers, batch_size) (and of the resplit point, in a re-split epoch).
"""
from __future__ import annotations

import json
import os
import random
from functools import partial

import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from mplug_pretrain.data.device_normalize import DeviceNormalize
from mplug_pretrain.data.formats.image_decode import set_max_image_pixels
from mplug_pretrain.data.formats.manifest import (
    dataset_entry,
    listed_kinds,
    local_path,
    manifest_path,
    shard_sample_counts,
)
from mplug_pretrain.data.formats.samples import CaptionEvalFormat, ImageTextFormat, VideoFormat, VQAFormat
from mplug_pretrain.data.reading.decode_stats import DecodeStats
from mplug_pretrain.data.reading.epoch_plan import (
    ExactPlan,
    derive_seed,
    local_skip,
    logical_slot,
    resampled_batches_per_slot,
    slot_seed,
)
from mplug_pretrain.data.reading.loader import ShardLoader
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.resplit import IndexMask, Remainder, exact_remainder, resampled_remainder
from mplug_pretrain.data.reading.stages import (
    SeededRandomMix,
    batch_by_position,
    decode_samples,
    keep_listed,
    number_positions,
    resampled_urls,
    seeded_shuffle,
    skip_positions,
    take_every,
    tar_samples,
    url_list,
)
from mplug_pretrain.data.reading.urls import ShardSource, all_shards, expand_sources
from mplug_pretrain.data.transforms import (
    CLIP_MEAN,
    CLIP_STD,
    build_eval_transform,
    build_eval_transform_uint8,
    build_train_transform,
    build_train_transform_uint8,
)
from mplug_pretrain.errors import ConfigError, DataError
from mplug_pretrain.utils import process_group


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
    """The per-worker stream of ready batches for one rank (see the module docstring). ``epoch`` and
    ``start_batch`` start at the spec's and move with ``ShardLoader.set_epoch``; they live in a shared-memory
    tensor, so persistent DataLoader workers (which keep their copy of this object) read the new position at the
    start of each pass. ``remainder``: epoch ``spec.epoch`` re-split from another layout (``spec.resplit_from``);
    its batches are numbered on from those that layout consumed, and later epochs follow ``plan``."""

    def __init__(self, spec: LoaderSpec, fmt, sources: list[ShardSource], rank: int, world_size: int,
                 plan: ExactPlan | None, batches_per_slot: int, remainder: Remainder | None = None):
        super().__init__()
        self.spec, self.fmt, self.sources, self.rank, self.world_size = spec, fmt, sources, rank, world_size
        self.plan, self.batches_per_slot, self.remainder = plan, batches_per_slot, remainder
        self.position = torch.tensor([spec.epoch, spec.start_batch], dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self.position[0])

    @property
    def start_batch(self) -> int:
        return int(self.position[1])

    def move_to(self, epoch: int, start_batch: int) -> None:
        self.position[0], self.position[1] = epoch, start_batch

    def _rest(self, epoch: int) -> Remainder | None:
        return self.remainder if self.remainder is not None and self.remainder.epoch == epoch else None

    def first_batch(self, epoch: int) -> int:
        """The first batch of ``epoch`` this loader can yield: after those another layout consumed (re-split)."""
        rest = self._rest(epoch)
        return rest.first_batch if rest else 0

    def num_batches(self, epoch: int) -> int:
        """Batches per rank of ``epoch`` (the same on every rank), a re-split epoch's earlier layout's included."""
        rest = self._rest(epoch)
        return self.first_batch(epoch) + self.spec.workers * (rest.batches_per_slot if rest else self.batches_per_slot)

    def __iter__(self):
        info = get_worker_info()
        running, workers, batch_size = info.num_workers if info else 1, self.spec.workers, self.spec.batch_size
        if running != workers:
            raise RuntimeError(f"ShardStream planned for {workers} worker(s) runs in {running}; "
                               "iterate it through its ShardLoader")
        set_max_image_pixels(self.spec.max_image_pixels)  # in the process that decodes (a worker)
        rest = self._rest(self.epoch)
        batches_per_slot = rest.batches_per_slot if rest else self.batches_per_slot
        position = self.start_batch - self.first_batch(self.epoch)  # rank batches of this layout already yielded
        slot = logical_slot(info.id if info else 0, workers, position)
        global_slot = self.rank * workers + slot
        skip = local_skip(position, slot, workers)
        seed = slot_seed(self.spec.seed, self.epoch, global_slot)
        if rest:
            seed = derive_seed(seed, "resplit")  # resampled: not the draws the slot of that number made before
        if batches_per_slot == 0:  # a re-split epoch with nothing left
            return iter(())
        stats = DecodeStats()
        plan, keep = (rest.plan, rest.keep) if rest else (self.plan, {})
        raw = (self._exact_stages(plan, keep, global_slot, seed, stats) if self.spec.mode == "exact"
               else self._resampled_stages(seed, stats, batches_per_slot))
        return iter(wds.DataPipeline(raw + [
            partial(skip_positions, first=skip * batch_size),
            partial(decode_samples, decode=partial(self.fmt.decode, seed=seed), stats=stats),
            partial(batch_by_position, batch_size=batch_size, first_batch=skip,
                    num_batches=batches_per_slot, collate=self.fmt.collate, blank=self.fmt.blank, stats=stats),
        ]))

    def _exact_stages(self, plan: ExactPlan, keep: dict[str, IndexMask], global_slot: int, seed: int,
                      stats: DecodeStats) -> list:
        assignment = plan.assignment(self.epoch, global_slot)
        counts = dict(zip(self.plan.shards, self.plan.counts))  # whole shards (``plan`` may count a remainder)
        stages = [partial(url_list, assignment.shards),
                  # with a sample split every slot reads every shard: slot 0 alone reports broken shards
                  partial(tar_samples, stats=stats, expected=counts,
                          count_shard_errors=assignment.stride == 1 or global_slot == 0)]
        if keep:
            stages.append(partial(keep_listed, keep=keep))
        if assignment.stride > 1:
            stages.append(partial(take_every, stride=assignment.stride, offset=assignment.offset))
        if self.spec.shuffle:
            stages.append(seeded_shuffle(self.spec.shuffle_buffer, derive_seed(seed, "samples")))
        stages.append(partial(number_positions, stats=stats, expected=assignment.expected))
        return stages

    def _resampled_stages(self, seed: int, stats: DecodeStats, batches_per_slot: int) -> list:
        per_source = []
        for i, src in enumerate(self.sources):
            shuffle = (seeded_shuffle(self.spec.shuffle_buffer, derive_seed(seed, "samples", i)) if self.spec.shuffle
                       else None)
            per_source.append(wds.DataPipeline(
                partial(resampled_urls, src.shards, random.Random(derive_seed(seed, i))),
                partial(tar_samples, stats=stats), shuffle))
        mixed = (per_source[0] if len(per_source) == 1 else
                 SeededRandomMix(per_source, [s.weight for s in self.sources], random.Random(derive_seed(seed, "mix"))))
        return [mixed, partial(number_positions, stats=stats, limit=batches_per_slot * self.spec.batch_size)]


def _check_local_shards(shards: list[str]) -> None:
    missing = [u for u in shards if local_path(u) is not None and not os.path.exists(local_path(u))]
    if missing:
        raise DataError(f"{len(missing)} of {len(shards)} shard file(s) do not exist, e.g. {missing[0]}")


def check_shard_kind(shards: list[str], fmt) -> None:
    """Refuse shards whose manifest records another kind than the format reads (``fmt.shard_kinds``): VQA shards
    given to pretraining decoded nothing (every sample ``missing_caption``) and the run still exited 0."""
    wanted = getattr(fmt, "shard_kinds", None)
    if not wanted:
        return
    for url, kind in listed_kinds(shards).items():
        if kind not in wanted:
            folder = os.path.dirname(os.path.abspath(local_path(url)))
            raise DataError(f"{url}: {manifest_path(folder)} lists it as {kind!r} shards; this command reads "
                            f"{' or '.join(repr(k) for k in wanted)} shards (see `mplug make-shards --help`)")


def build_loader(spec: LoaderSpec, fmt, answer_list: list[str] | None = None,
                 image_normalize: DeviceNormalize | None = None) -> ShardLoader:
    """Any sample format; the public builders below make the format from sizes and a tokenizer.
    ``image_normalize``: the format's images are uint8 and the consumer normalises them with it."""
    rank, world_size = _rank_and_world_size(spec.rank, spec.world_size)
    sources = expand_sources(spec.urls, spec.weights)
    shards = all_shards(sources)
    _check_local_shards(shards)
    check_shard_kind(shards, fmt)
    plan, remainder, point = None, None, spec.resplit_from
    if point is not None and (point.batches == 0 or point.layout == (world_size, spec.workers, spec.batch_size)):
        point = None  # nothing consumed, or the same layout: the ordinary walk
    if spec.mode == "exact":
        plan = ExactPlan(shards, shard_sample_counts(shards), world_size=world_size, workers=spec.workers,
                         batch_size=spec.batch_size, shuffle=spec.shuffle, seed=spec.seed)
        batches_per_slot = plan.batches_per_slot
        if point is not None:  # replays the old layout's positions from the shard counts (resplit.py)
            remainder = exact_remainder(plan, point, epoch=spec.epoch, shuffle_buffer=spec.shuffle_buffer)
    else:
        total = spec.samples_per_epoch if spec.samples_per_epoch is not None else sum(shard_sample_counts(shards))
        batches_per_slot = resampled_batches_per_slot(total, batch_size=spec.batch_size, world_size=world_size,
                                                      workers=spec.workers)
        if point is not None:
            remainder = resampled_remainder(total, point, epoch=spec.epoch, batch_size=spec.batch_size,
                                            world_size=world_size, workers=spec.workers)
    stream = ShardStream(spec, fmt, sources, rank, world_size, plan, batches_per_slot, remainder)
    return ShardLoader(stream, answer_list=answer_list, image_normalize=image_normalize)


def _image_transform(image_size: int, augment: bool):
    return build_train_transform(image_size) if augment else build_eval_transform(image_size)


def training_images(image_size: int, augment: bool) -> dict:
    """The keyword arguments of a training format that sends uint8 images (normalised by the training step on
    its device, ``DeviceNormalize`` with CLIP's mean / std, as the float transform) and drafts large JPEGs
    (``augment`` only: the crop is then still >= 1.2x the target; the eval transform stays exact)."""
    transform = build_train_transform_uint8(image_size) if augment else build_eval_transform_uint8(image_size)
    return {"transform": transform, "image_dtype": torch.uint8, "draft_side": 2 * image_size if augment else None}


def build_pretrain_loader(spec: LoaderSpec, tokenizer, *, image_size: int, max_text_len: int,
                          augment: bool, uint8_images: bool = False) -> ShardLoader:
    """Image-text batches (pretraining, caption fine-tuning); ``augment``: the training augmentation, else the
    eval transform. ``uint8_images``: uint8 [B, 3, H, W] images and ``loader.image_normalize`` for the training
    step (train/loop.py applies it), else float32 normalised in the workers."""
    if uint8_images:
        fmt = ImageTextFormat(tokenizer=tokenizer, max_text_len=max_text_len, image_size=image_size,
                              **training_images(image_size, augment))
        return build_loader(spec, fmt, image_normalize=DeviceNormalize(CLIP_MEAN, CLIP_STD))
    return build_loader(spec, ImageTextFormat(_image_transform(image_size, augment), tokenizer, max_text_len,
                                              image_size))


def load_answer_list(urls) -> list[str] | None:
    """The answer list a VQA writer named in the manifest of the first shard's folder, if any."""
    first = all_shards(expand_sources(urls))[0]
    entry = dataset_entry(first)
    if not entry or not entry.get("answer_list"):
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(local_path(first))), entry["answer_list"])
    with open(path) as f:
        return json.load(f)


def build_vqa_loader(spec: LoaderSpec, tokenizer, *, image_size: int, max_text_len: int,
                     augment: bool) -> ShardLoader:
    """VQA batches; ``loader.answer_list`` is the shards' answer list (None when not written)."""
    fmt = VQAFormat(_image_transform(image_size, augment), tokenizer, max_text_len, image_size)
    return build_loader(spec, fmt, answer_list=load_answer_list(spec.urls))


def build_caption_eval_loader(spec: LoaderSpec, *, image_size: int) -> ShardLoader:
    """Evaluation images with their reference captions (``LoaderSpec.evaluation``: exact, no shuffle, pads
    flagged)."""
    return build_loader(spec, CaptionEvalFormat(build_eval_transform(image_size), image_size))


def build_video_loader(spec: LoaderSpec, *, num_frames: int | None = None, image_size: int | None = None,
                       frame_mode: str = "uniform", backend: str = "auto") -> ShardLoader:
    """Raw video bytes + captions/QA (``LoaderSpec.evaluation``). With ``num_frames`` (and ``image_size``)
    also ``video`` float32 [B, N, 3, H, W] decoded by ``data.formats.video_frames.decode_frames``."""
    if num_frames is not None and image_size is None:
        raise ConfigError("eval.num_frames: decoding frames needs image_size too")
    transform = build_eval_transform(image_size) if num_frames is not None else None
    return build_loader(spec, VideoFormat(num_frames, frame_mode, transform, image_size, backend))
