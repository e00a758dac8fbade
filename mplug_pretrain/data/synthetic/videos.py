"""Procedural video-text data: one coloured shape moving across a static textured background,
encoded as a real mp4 (PyAV, MPEG-4 part 2) with captions ("a red circle moving right") and
question/answer pairs. Same seed -> same motion, frames and text.
"""
from __future__ import annotations

import io
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageDraw

from mplug_pretrain.data.synthetic.scenes import (
    BACKGROUNDS,
    COLORS,
    SHAPES,
    SIZES,
    draw_shape,
    render_background,
)

DIRECTIONS = {"right": (1.0, 0.0), "left": (-1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
TRAVEL = (0.2, 0.8)  # the shape travels between these fractions of the side


@dataclass(frozen=True)
class Motion:
    shape: str
    color: str
    size: str
    direction: str
    cross: float  # the fixed coordinate (fraction of the side) perpendicular to the motion
    background: str

    def to_json(self) -> dict:
        return asdict(self)


def sample_motion(rng: np.random.Generator) -> Motion:
    return Motion(shape=str(rng.choice(SHAPES)), color=str(rng.choice(list(COLORS))),
                  size=str(rng.choice(list(SIZES))), direction=str(rng.choice(list(DIRECTIONS))),
                  cross=float(rng.uniform(0.35, 0.65)), background=str(rng.choice(BACKGROUNDS)))


def motion_centers(motion: Motion, num_frames: int, size: int) -> np.ndarray:
    """[num_frames, 2] pixel centres (x, y) along the path."""
    dx, dy = DIRECTIONS[motion.direction]
    start, end = TRAVEL if (dx + dy) > 0 else TRAVEL[::-1]
    along = np.linspace(start, end, num_frames)
    cross = np.full(num_frames, motion.cross)
    xy = np.stack([along, cross], 1) if dx != 0 else np.stack([cross, along], 1)
    return xy * size


def render_motion_frames(motion: Motion, num_frames: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [num_frames, size, size, 3]."""
    background = np.clip(render_background(motion.background, size, rng), 0, 255).astype(np.uint8)
    frames = []
    for center in motion_centers(motion, num_frames, size):
        image = Image.fromarray(background, "RGB")
        draw_shape(ImageDraw.Draw(image), motion.shape, (float(center[0]), float(center[1])),
                   SIZES[motion.size] * size, COLORS[motion.color])
        frames.append(np.asarray(image))
    return np.stack(frames)


def encode_mp4(frames: np.ndarray, fps: int = 8) -> bytes:
    """MPEG-4 part 2 in an mp4 container, yuv420p, one thread: same frames -> same bytes.
    (libx264 here gave a few bytes' difference between runs on some clips.)"""
    import av  # optional dependency (extra "video")

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1  # deterministic bytes
        for frame in frames:
            # converting to yuv420p here, not inside encode(), keeps the bytes reproducible
            yuv = av.VideoFrame.from_ndarray(frame, format="rgb24").reformat(format="yuv420p")
            for packet in stream.encode(yuv):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def motion_captions(motion: Motion) -> list[str]:
    s, c, d = motion.shape, motion.color, motion.direction
    return [f"a {c} {s} moving {d}", f"a {motion.size} {c} {s} moves {d}",
            f"a video of a {c} {s} going {d}"]


def motion_questions(motion: Motion) -> list[dict]:
    return [{"question": "which direction is the shape moving?", "answer": motion.direction},
            {"question": "what color is the moving shape?", "answer": motion.color},
            {"question": "what shape is moving?", "answer": motion.shape},
            {"question": "is the moving shape large or small?", "answer": motion.size}]
