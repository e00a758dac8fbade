"""Zero-shot video input for an image model (mPLUG §5.4.2): a video is its N sampled frames.

    record (path or bytes) --decode_frames(N, uniform|middle)--> N RGB frames --eval transform--> [N, 3, H, W]
    frames [B, N, 3, H, W] --encode_image per frame--> X [B*N, 1+M, D]
    states   = X viewed as [B, N*(1+M), D]: the frames' token sequences concatenated in time order,
               the visual input of fusion, ITM and the decoder memory
    features = normalize(mean_n vision_proj(X[b, n, 0]))  [B, E]: ITC feature, the mean of the frames'
               projected [CLS] (mPLUG ``retrieval_vid_mplug.py``: project, average, then L2-normalize)
No temporal modelling. A video that cannot be used (missing file, zero bytes, undecodable, truncated,
no frames) is left out of its batch and recorded in a ``SkipReport`` (count per reason, first names);
the rest of the batch is evaluated. Sources: our video shards (``make-shards video`` / synthetic), or
records a task read from a dataset's own annotation file, with files under a video folder.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from PIL import Image

from mplug_pretrain.data.formats.video_frames import VideoDecodeError, decode_frames
from mplug_pretrain.data.writers.video import find_video
from mplug_pretrain.errors import ConfigError, DataError
from mplug_pretrain.tasks.evaluation import SkipReport


@dataclass
class VideoRecord:
    """One video to evaluate: its id, file path or bytes, reference captions and question/answer pairs."""
    video_id: str
    source: bytes | str
    captions: list[str] = field(default_factory=list)
    qa: list[dict] = field(default_factory=list)


@dataclass
class FrameSpec:
    """How frames are taken from a video: N, sampling mode, decoder backend, square size, decode threads."""
    num_frames: int
    mode: str = "uniform"
    backend: str = "auto"
    image_size: int = 224
    workers: int = 0


def shard_records(shards: str, batch_size: int, num_workers: int,
                  skipped: SkipReport) -> Iterator[list[VideoRecord]]:
    """Batches of records from video shards (raw bytes; the reader's own skips are added to ``skipped``
    when the shards are exhausted)."""
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_video_loader
    loader = build_video_loader(LoaderSpec.evaluation(shards, batch_size, num_workers))
    for batch in loader:
        yield [VideoRecord(str(batch["video_id"][i]), batch["video_bytes"][i], list(batch["captions"][i]),
                           list(batch["qa"][i]))
               for i in range(len(batch["is_pad"])) if not bool(batch["is_pad"][i])]
    skipped.add_counts(loader.stats.skipped)


def file_records(entries: Iterable[tuple[str, list[str], list[dict]]], video_root: str,
                 skipped: SkipReport) -> list[VideoRecord]:
    """(file reference, captions, qa) -> records with paths under ``video_root`` (extension optional);
    a reference with no file is skipped as ``missing_video``."""
    records = []
    for ref, captions, qa in entries:
        path = find_video(video_root, ref)
        if path is None:
            skipped.add(ref, "missing_video", f"no file {os.path.join(video_root, ref)}[.mp4|.avi|...]")
            continue
        records.append(VideoRecord(ref, path, captions, qa))
    return records


def nothing_evaluated(what: str, cfg, skipped: SkipReport) -> DataError:
    """The error when no video could be used: the counts, the first example (the path tried) and, when files were
    missing, the fields that name them."""
    message = f"{what} ({skipped.total} videos skipped: {dict(skipped.reasons)})"
    if skipped.examples:
        message += f"; e.g. {skipped.examples[0]}"
    if skipped.reasons.get("missing_video") and cfg.eval.annotations is not None:
        message += (f"; the file names come from eval.video_name_format {cfg.eval.video_name_format!r} under "
                    f"eval.video_root {cfg.eval.video_root}")
    return DataError(message)


def video_record_batches(cfg, read_annotations, skipped: SkipReport):
    """Batches of VideoRecords from ``eval.shards``, or from ``eval.annotations`` read by ``read_annotations``
    (path, name_format) with the files under ``eval.video_root``."""
    e = cfg.eval
    if (e.shards is None) == (e.annotations is None):
        raise ConfigError("eval.shards / eval.annotations: set exactly one (the videos to evaluate)")
    if e.shards is not None:
        return shard_records(e.shards, e.batch_size, e.num_workers, skipped)
    if e.video_root is None:
        raise ConfigError("eval.video_root: needed with eval.annotations (the folder of the video files)")
    return chunks(file_records(read_annotations(e.annotations, e.video_name_format), e.video_root, skipped),
                  e.batch_size)


def frame_spec(cfg, model) -> FrameSpec:
    e = cfg.eval
    return FrameSpec(e.num_frames, e.frame_sampling, e.video_backend, model.config.vision.image_size,
                     e.num_workers)


def chunks(records: list[VideoRecord], size: int) -> Iterator[list[VideoRecord]]:
    for start in range(0, len(records), size):
        yield records[start:start + size]


def _frames_of(record: VideoRecord, spec: FrameSpec, transform) -> torch.Tensor | VideoDecodeError:
    try:
        frames = decode_frames(record.source, spec.num_frames, mode=spec.mode, backend=spec.backend,
                               name=record.video_id)
    except VideoDecodeError as err:
        return err
    return torch.stack([transform(Image.fromarray(frame)) for frame in frames])


def decode_records(records: list[VideoRecord], spec: FrameSpec,
                   skipped: SkipReport) -> tuple[torch.Tensor | None, list[VideoRecord]]:
    """-> (frames float32 [B', N, 3, S, S] or None when nothing decodes, the B' records kept, in order)."""
    from mplug_pretrain.data.transforms import build_eval_transform
    transform = build_eval_transform(spec.image_size)
    if spec.workers > 1 and len(records) > 1:  # PyAV / decord release the GIL while decoding
        with ThreadPoolExecutor(spec.workers) as pool:
            results = list(pool.map(lambda r: _frames_of(r, spec, transform), records))
    else:
        results = [_frames_of(r, spec, transform) for r in records]
    kept, frames = [], []
    for record, result in zip(records, results):
        if isinstance(result, VideoDecodeError):
            skipped.add(record.video_id, "corrupt_video", result.reason)
            continue
        kept.append(record)
        frames.append(result)
    return (torch.stack(frames) if frames else None), kept


@torch.no_grad()
def encode_videos(model, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """frames [B, N, 3, H, W] -> (states [B, N*(1+M), D], ITC features [B, E]) (module docstring)."""
    if frames.ndim != 5:
        raise ValueError(f"frames: expected [B, N, 3, H, W], got shape {tuple(frames.shape)}")
    b, n = frames.shape[:2]
    tokens = model.encode_image(frames.flatten(0, 1))  # [B*N, 1+M, D]
    states = tokens.reshape(b, n * tokens.shape[1], tokens.shape[2])
    projected = model.itc.vision_proj(tokens[:, 0]).float().view(b, n, -1)
    return states, F.normalize(projected.mean(1), dim=-1)


def encoded_batches(model, record_batches: Iterable[list[VideoRecord]], spec: FrameSpec,
                    skipped: SkipReport) -> Iterator[tuple[list[VideoRecord], torch.Tensor, torch.Tensor]]:
    """(records kept, states, features) per batch; batches where nothing decodes are dropped."""
    device = next(model.parameters()).device
    for records in record_batches:
        frames, kept = decode_records(records, spec, skipped)
        if frames is None:
            continue
        states, features = encode_videos(model, frames.to(device))
        yield kept, states, features
