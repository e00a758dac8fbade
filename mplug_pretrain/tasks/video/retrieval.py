"""``mplug eval video-retrieval``: zero-shot text <-> video retrieval (mPLUG §5.4.2, Table 9).

Input (``cfg.eval``), one of:
  * ``shards``: our video shards (``make-shards video`` / synthetic; captions in ``json.captions``);
  * ``annotations`` + ``video_root``: MSRVTT 1k-A as BLIP/mPLUG ship it (``msrvtt_test.jsonl``, one
    ``{"clip_name": "video9770", "caption": "..."}`` per line), the JSFusion CSV
    (``MSRVTT_JSFUSION_test.csv``: ``video_id``, ``sentence``), or any JSON/JSONL list whose records name a
    video (clip_name | video_id | videoID | video | vid, file name via ``eval.video_name_format``) and carry
    caption | captions | sentence | enCap (VATEX); records of one video are merged.
Each video: ``eval.num_frames`` frames (``frame_sampling``), encoded by ``tasks/video/encoding.py``; then
the retrieval protocol of ``metrics/retrieval_scoring.py`` (ITC top-``k_test``, ITM re-rank; mPLUG's video script
scores ITM + ITC: ``rerank_score: itm+itc``). Unusable videos are skipped and counted (their captions
leave the text pool too); a video without any caption is skipped as ``no_caption``.
Metrics JSON: txt_r1/5/10 (video -> text), vid_r1/5/10 (text -> video), means, ``itc`` (before
re-ranking), num_videos, num_texts, videos_skipped, skip_reasons, the frame settings.
"""
from __future__ import annotations

import csv
import logging

import torch

from mplug_pretrain.errors import DataError
from mplug_pretrain.metrics.retrieval_scoring import TextBank, VisualBank, embed_texts, evaluate_retrieval
from mplug_pretrain.tasks.evaluation import eval_autocast, load_eval_model, metrics_path, write_metrics
from mplug_pretrain.tasks.video.encoding import (
    FrameSpec,
    SkipReport,
    VideoRecord,
    encoded_batches,
    frame_spec,
    video_record_batches,
)

log = logging.getLogger(__name__)

VIDEO_KEYS = ("clip_name", "video_id", "videoID", "video", "vid")
CAPTION_KEYS = ("caption", "captions", "sentence", "enCap")


def read_caption_annotations(path: str, name_format: str = "{}") -> list[tuple[str, list[str], list[dict]]]:
    """(video file reference, captions, []) per video, in first-appearance order (module docstring)."""
    from mplug_pretrain.data.writers.common import load_records
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            records = list(csv.DictReader(f))
    else:
        records = load_records(path)
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a list of records (JSON list, JSON Lines or CSV)")
    grouped: dict[str, list[str]] = {}
    for i, record in enumerate(records):
        video_key = next((k for k in VIDEO_KEYS if isinstance(record, dict) and k in record), None)
        caption_key = next((k for k in CAPTION_KEYS if isinstance(record, dict) and k in record), None)
        if video_key is None or caption_key is None:
            raise DataError(f"{path}: record {i} needs a video ({' | '.join(VIDEO_KEYS)}) and a caption "
                            f"({' | '.join(CAPTION_KEYS)})")
        value = record[caption_key]
        grouped.setdefault(name_format.format(record[video_key]), []).extend(
            [str(c) for c in value] if isinstance(value, list) else [str(value)])
    return [(ref, captions, []) for ref, captions in grouped.items()]


def encode_video_set(model, record_batches, spec: FrameSpec,
                     skipped: SkipReport) -> tuple[VisualBank, list[VideoRecord]]:
    """Every decodable video with at least one caption -> (VisualBank, its records in bank order)."""
    states, features, kept = [], [], []
    for records, batch_states, batch_features in encoded_batches(model, record_batches, spec, skipped):
        has_text = torch.tensor([bool(r.captions) for r in records], device=batch_states.device)
        for record in records:
            if not record.captions:
                skipped.add(record.video_id, "no_caption", "no caption to retrieve")
        states.append(batch_states[has_text])
        features.append(batch_features[has_text])
        kept.extend(r for r in records if r.captions)
    if not kept:
        raise DataError(f"no video could be evaluated ({skipped.total} skipped: {dict(skipped.reasons)})")
    return VisualBank(torch.cat(states), torch.cat(features)), kept


def encode_captions(cfg, model, videos: list[VideoRecord]) -> tuple[TextBank, list[int]]:
    from mplug_pretrain.data.tokenizer import load_tokenizer, tokenize
    texts = [c for video in videos for c in video.captions]
    text_to_video = [i for i, video in enumerate(videos) for _ in video.captions]
    ids, mask = tokenize(load_tokenizer(cfg.data.tokenizer), texts, cfg.eval.max_text_len)
    return embed_texts(model, ids, mask, cfg.eval.batch_size), text_to_video


def evaluate(cfg, model) -> dict:
    """Video retrieval metrics of ``model`` on the videos ``cfg.eval`` names (module docstring)."""
    e = cfg.eval
    skipped = SkipReport()
    batches = video_record_batches(cfg, read_caption_annotations, skipped)
    with eval_autocast(cfg, model):
        visual, videos = encode_video_set(model, batches, frame_spec(cfg, model), skipped)
        text, text_to_video = encode_captions(cfg, model, videos)
        log.info("video-retrieval: %d videos (%d skipped), %d texts; re-ranking (%s, k=%d)", len(videos),
                 skipped.total, len(text_to_video), e.rerank_score, e.k_test)
        recalls = evaluate_retrieval(model, visual, text, text_to_video, e.k_test, e.rerank_score,
                                     e.batch_size, visual_name="vid")
    return {"task": "video-retrieval", "num_videos": len(videos), "num_texts": len(text_to_video),
            **skipped.as_dict("videos"), "num_frames": e.num_frames, "frame_sampling": e.frame_sampling,
            **recalls}


def run(cfg, checkpoint: str, out: str | None = None) -> dict:
    """``mplug eval video-retrieval --config FILE --checkpoint DIR [--out FILE]`` -> metrics (written)."""
    metrics = {**evaluate(cfg, load_eval_model(cfg, checkpoint)), "checkpoint": checkpoint}
    write_metrics(metrics_path(cfg, "video-retrieval", out), metrics)
    return metrics
