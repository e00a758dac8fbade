"""The embedded demo data, made deterministically on first use (a few seconds; nothing committed).

    ROOT/pretrain/train-{000000..000003}.tar  2000 synthetic scenes x 2 captions (pair layout)
    ROOT/pretrain/val-000000.tar              250 scenes, 3 captions each (image layout: retrieval)
    ROOT/caption/train-{000000..000001}.tar   1000 scenes x 2 captions (pair layout)
    ROOT/caption/val-000000.tar               200 scenes, 3 reference captions each (image layout)
    ROOT/vqa/train-*.tar, val-000000.tar      easy-vqa: 6000 train questions, 1000 test questions
    ROOT/video/val-000000.tar                 96 synthetic mp4 videos (moving shape) + captions/QA
    ROOT/vocab/vocab.txt                      the demo's 268-row word-piece vocabulary (``demo.vocab``)
Images are 64x64 (the tiny preset's resolution). A marker ``ROOT/.demo_complete.json`` records
the recipe version; a file lock lets several processes (ranks) call this at once.
"""
from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable

from mplug_pretrain.data.formats.manifest import read_manifest
from mplug_pretrain.data.reading.urls import all_shards, expand_sources
from mplug_pretrain.data.writers.easy_vqa import write_easy_vqa_shards
from mplug_pretrain.data.writers.shard_writer import shard_pattern
from mplug_pretrain.data.writers.synthetic import write_synthetic_image_shards, write_synthetic_video_shards
from mplug_pretrain.demo.vocab import shard_texts, write_demo_vocab
from mplug_pretrain.utils.atomic_files import write_json_atomic

DEMO_VERSION = 2
VOCAB_FOLDER = "vocab"
CAPTION_PROMPT = "a picture of"  # configs/caption_demo.yaml's prompt: its words must be in the vocabulary
MARKER = ".demo_complete.json"

# name -> (folder, shard name, writer(out, name) -> manifest entry)
RECIPE: dict[str, tuple[str, str, Callable[[str, str], dict]]] = {
    "pretrain_train": ("pretrain", "train", lambda out, name: write_synthetic_image_shards(
        out, name=name, num_scenes=2000, captions_per_scene=2, layout="pair", seed=0, overwrite=True)),
    "pretrain_val": ("pretrain", "val", lambda out, name: write_synthetic_image_shards(
        out, name=name, num_scenes=250, captions_per_scene=3, layout="image", seed=1, overwrite=True)),
    "caption_train": ("caption", "train", lambda out, name: write_synthetic_image_shards(
        out, name=name, num_scenes=1000, captions_per_scene=2, layout="pair", seed=2, overwrite=True)),
    "caption_val": ("caption", "val", lambda out, name: write_synthetic_image_shards(
        out, name=name, num_scenes=200, captions_per_scene=3, layout="image", seed=3, overwrite=True)),
    "vqa_train": ("vqa", "train", lambda out, name: write_easy_vqa_shards(
        out, name=name, split="train", max_questions=6000, seed=0, overwrite=True)),
    "vqa_val": ("vqa", "val", lambda out, name: write_easy_vqa_shards(
        out, name=name, split="test", max_questions=1000, seed=0, overwrite=True)),
    "video": ("video", "val", lambda out, name: write_synthetic_video_shards(
        out, name=name, num_videos=96, seed=4, overwrite=True)),
}


def _paths(root: str, entries: dict[str, dict]) -> dict[str, str]:
    paths = {key: shard_pattern(os.path.join(root, folder), name, len(entries[key]["shards"]))
             for key, (folder, name, _) in RECIPE.items()}
    paths["vqa_answer_list"] = os.path.join(root, "vqa", entries["vqa_train"]["answer_list"])
    paths["tokenizer"] = os.path.join(root, VOCAB_FOLDER)
    return paths


def _complete(root: str) -> dict[str, str] | None:
    try:
        with open(os.path.join(root, MARKER)) as f:
            marker = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    if marker.get("version") != DEMO_VERSION:
        return None
    entries = {}
    for key, (folder, name, _) in RECIPE.items():
        entry = read_manifest(os.path.join(root, folder))["datasets"].get(name)
        if entry is None or not all(os.path.exists(os.path.join(root, folder, s["file"])) for s in entry["shards"]):
            return None
        entries[key] = entry
    if not os.path.isfile(os.path.join(root, VOCAB_FOLDER, "vocab.txt")):
        return None
    return _paths(root, entries)


def ensure_demo_shards(root: str = "data_shards") -> dict[str, str]:
    """Shard patterns of the demo data sets (made now if missing or from an older recipe):
    pretrain_train, pretrain_val, caption_train, caption_val, vqa_train, vqa_val, vqa_answer_list, video,
    tokenizer (the vocabulary folder every demo stage passes as ``data.tokenizer``)."""
    paths = _complete(root)
    if paths is not None:
        return paths
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".demo.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be writing them right now
        paths = _complete(root)
        if paths is not None:
            return paths
        entries = {key: writer(os.path.join(root, folder), name) for key, (folder, name, writer) in RECIPE.items()}
        paths = _paths(root, entries)
        shard_files = [url for key in RECIPE for url in all_shards(expand_sources(paths[key]))]
        write_demo_vocab(paths["tokenizer"], [CAPTION_PROMPT, *shard_texts(shard_files)])
        write_json_atomic(os.path.join(root, MARKER), {"version": DEMO_VERSION}, indent=None)
        return paths
