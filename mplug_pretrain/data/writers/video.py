"""``make-shards video``: a folder of videos (+ optional captions/QA JSON) as shards holding the raw
file bytes (``KEY.mp4`` / ``KEY.avi`` / ...), ``KEY.txt`` (first caption) and ``KEY.json``.

Annotations: a JSON list, JSON Lines, or an object ``{video: [captions]}``. Each record names its
video under ``video_key`` (default: the first of video, clip_name, video_id, videoID, vid) and carries
captions under ``caption_key`` (default: the first of caption, captions, enCap (VATEX); a str or a list),
``question`` + ``answer``, or ``qa`` [{question, answer}]; records of one video are merged (MSRVTT-QA has one
record per question). Annotations in which no record has a caption or a question are refused (the field is
named otherwise: give ``--caption-key``). A video reference is a
file name relative to the folder, with or without its extension. Without annotations every video
file in the folder is written with no text. json: video_id (the reference), video (file name),
captions, qa.
"""
from __future__ import annotations

import os

from mplug_pretrain.data.writers.common import load_records
from mplug_pretrain.data.writers.shard_writer import ShardWriter, created_by
from mplug_pretrain.errors import DataError

VIDEO_EXTS = (".mp4", ".avi", ".webm", ".mkv", ".mov", ".m4v")
VIDEO_KEYS = ("video", "clip_name", "video_id", "videoID", "vid")
CAPTION_KEYS = ("caption", "captions", "enCap")


def find_video(root: str, ref: str) -> str | None:
    path = os.path.join(root, ref)
    if os.path.isfile(path):
        return path
    for ext in VIDEO_EXTS:
        if os.path.isfile(path + ext):
            return path + ext
    return None


def _records(annotations: str) -> list[dict]:
    data = load_records(annotations)
    if isinstance(data, dict):
        return [{"video": k, "captions": v if isinstance(v, list) else [v]} for k, v in data.items()]
    if not isinstance(data, list):
        raise DataError(f"{annotations}: expected a list, JSON Lines or {{video: [captions]}}")
    return data


def group_annotations(annotations: str, video_key: str | None = None,
                      caption_key: str | None = None) -> dict[str, dict]:
    """{video reference: {"captions": [...], "qa": [...]}} in first-appearance order."""
    grouped: dict[str, dict] = {}
    records = _records(annotations)
    for i, record in enumerate(records):
        key = video_key or next((k for k in VIDEO_KEYS if k in record), None)
        if key is None or key not in record:
            raise DataError(f"{annotations}: record {i} names no video (looked for {video_key or VIDEO_KEYS})")
        entry = grouped.setdefault(str(record[key]), {"captions": [], "qa": []})
        if caption_key is not None and caption_key not in record and "question" not in record:
            raise DataError(f"{annotations}: record {i} has no {caption_key!r} (--caption-key); its fields: "
                            f"{sorted(record)}")
        field = caption_key or next((k for k in CAPTION_KEYS if k in record), None)
        caption = record.get(field) if field else None
        entry["captions"] += caption if isinstance(caption, list) else ([caption] if caption else [])
        if "question" in record:
            entry["qa"].append({"question": record["question"], "answer": record.get("answer")})
        entry["qa"] += list(record.get("qa", []))
    if records and not any(e["captions"] or e["qa"] for e in grouped.values()):
        raise DataError(f"{annotations}: no record has a caption (looked for {caption_key or CAPTION_KEYS}) or a "
                        f"question; name the caption field with --caption-key (fields of record 0: "
                        f"{sorted(records[0]) if isinstance(records[0], dict) else type(records[0]).__name__})")
    return grouped


def write_video_shards(video_root: str, out: str, *, annotations: str | None = None, video_key: str | None = None,
                       caption_key: str | None = None, name: str = "video", skip_missing: bool = False, max_samples: int = 200,
                       max_bytes: int | None = None, overwrite: bool = False) -> dict:
    if annotations is not None:
        grouped = group_annotations(annotations, video_key, caption_key)
    else:
        files = sorted(f for f in os.listdir(video_root) if os.path.splitext(f)[1].lower() in VIDEO_EXTS)
        if not files:
            raise DataError(f"{video_root}: no video files ({', '.join(VIDEO_EXTS)})")
        grouped = {f: {"captions": [], "qa": []} for f in files}
    description = f"make-shards video --videos {video_root} --annotations {annotations}"
    with ShardWriter(out, name, kind="video", created_by=created_by(description), max_samples=max_samples,
                     max_bytes=max_bytes, overwrite=overwrite, extra={"layout": "image", "skipped_missing": 0}) as writer:
        for index, (ref, entry) in enumerate(grouped.items()):
            path = find_video(video_root, ref)
            if path is None:
                if not skip_missing:
                    raise DataError(f"video {ref!r}: no file in {video_root} (tried {VIDEO_EXTS}); "
                                    "skip with --skip-missing")
                writer.extra["skipped_missing"] += 1
                continue
            with open(path, "rb") as f:
                data = f.read()
            sample = {"__key__": f"{index:08d}", os.path.splitext(path)[1][1:].lower(): data,
                      "json": {"video_id": ref, "video": os.path.basename(path), **entry}}
            if entry["captions"]:
                sample["txt"] = entry["captions"][0]
            writer.write(sample)
    return writer.entry
