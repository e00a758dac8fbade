"""``make-shards synthetic``: procedural image-text shards (scenes of shapes) and video shards
(a moving shape, real mp4). Deterministic: scene/video ``i`` is drawn from ``default_rng([seed, i])``.

Image-text layouts: ``pair`` writes one sample per caption (``KEY = {image_id:08d}_{j}``; the
captions of one scene share ``image_id``: same-id positives); ``image`` writes one sample per
scene with all captions in ``json.captions`` and the first in ``txt`` (for caption evaluation).
json also holds the scene (objects with colour, shape, position, size, centre) and ``qa`` pairs.
"""
from __future__ import annotations

import numpy as np

from mplug_pretrain.data.synthetic.scenes import (
    encode_jpeg,
    render_scene,
    sample_scene,
    scene_captions,
    scene_questions,
)
from mplug_pretrain.data.synthetic.videos import (
    encode_mp4,
    motion_captions,
    motion_questions,
    render_motion_frames,
    sample_motion,
)
from mplug_pretrain.data.writers.shard_writer import ShardWriter, created_by
from mplug_pretrain.errors import DataError

LAYOUTS = ("pair", "image")


def write_synthetic_image_shards(out: str, *, num_scenes: int, captions_per_scene: int = 1, layout: str = "pair",
                                 seed: int = 0, image_size: int = 64, name: str = "synthetic",
                                 max_samples: int = 1000, max_bytes: int | None = None,
                                 overwrite: bool = False) -> dict:
    """Returns the manifest entry. ``num_scenes * captions_per_scene`` samples in ``pair`` layout."""
    if layout not in LAYOUTS:
        raise DataError(f"layout {layout!r} not in {LAYOUTS}")
    description = (f"make-shards synthetic --kind image --num {num_scenes} --captions-per-scene "
                   f"{captions_per_scene} --layout {layout} --seed {seed} --image-size {image_size}")
    with ShardWriter(out, name, kind="image-text", created_by=created_by(description), max_samples=max_samples,
                     max_bytes=max_bytes, overwrite=overwrite, extra={"layout": layout}) as writer:
        for image_id in range(num_scenes):
            rng = np.random.default_rng([seed, image_id])
            scene = sample_scene(rng, image_size)
            jpg = encode_jpeg(render_scene(scene, rng))
            captions = scene_captions(scene, captions_per_scene, rng)
            meta = {"image_id": image_id, "scene": scene.to_json(), "qa": scene_questions(scene, rng)}
            if layout == "image":
                writer.write({"__key__": f"{image_id:08d}", "jpg": jpg, "txt": captions[0],
                              "json": {**meta, "captions": captions}})
                continue
            for j, caption in enumerate(captions):
                writer.write({"__key__": f"{image_id:08d}_{j}", "jpg": jpg, "txt": caption,
                              "json": {**meta, "caption_index": j}})
    return writer.entry


def write_synthetic_video_shards(out: str, *, num_videos: int, seed: int = 0, num_frames: int = 16, size: int = 64,
                                 fps: int = 8, name: str = "synthetic_video", max_samples: int = 1000,
                                 max_bytes: int | None = None, overwrite: bool = False) -> dict:
    """One sample per video: ``mp4`` bytes, ``txt`` first caption, json: video_id, captions, qa, motion."""
    description = (f"make-shards synthetic --kind video --num {num_videos} --seed {seed} "
                   f"--num-frames {num_frames} --image-size {size}")
    with ShardWriter(out, name, kind="video", created_by=created_by(description), max_samples=max_samples,
                     max_bytes=max_bytes, overwrite=overwrite, extra={"layout": "image"}) as writer:
        for video_id in range(num_videos):
            rng = np.random.default_rng([seed, video_id])
            motion = sample_motion(rng)
            mp4 = encode_mp4(render_motion_frames(motion, num_frames, size, rng), fps=fps)
            captions = motion_captions(motion)
            writer.write({"__key__": f"{video_id:08d}", "mp4": mp4, "txt": captions[0],
                          "json": {"video_id": video_id, "captions": captions, "qa": motion_questions(motion),
                                   "motion": motion.to_json(), "num_frames": num_frames, "fps": fps}})
    return writer.entry
