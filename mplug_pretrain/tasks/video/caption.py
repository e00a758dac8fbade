"""``mplug eval video-caption``: zero-shot video captioning (mPLUG §5.4.2, Table 10: VATEX, CIDEr).

Input (``cfg.eval``), one of:
  * ``shards``: our video shards, references in ``json.captions``;
  * ``annotations`` + ``video_root``: VATEX (``vatex_validation_v1.0.json``: [{"videoID", "enCap": [10
    captions], ...}], files named "<videoID>.mp4") or any list read by
    ``tasks.video.retrieval.read_caption_annotations``.
Per video: memory = concat(fuse(video states, prompt)) of the N frames' tokens (``video_encoding``) and
``eval.generation.prompt`` ("[CLS] a video of [SEP]", the paper's; the released config uses "a picture of")
through the text encoder; beam search (eval.generation: beam_size, min_length..max_length tokens incl. [SEP],
length_penalty); the caption is the decoded continuation (as ``mplug eval caption``).
Scores (``eval.caption_metrics``): "coco" = pycocoevalcap BLEU-1..4, METEOR, ROUGE-L, CIDEr, SPICE where its
jars are present (Java checked before any video is captioned); "cider" = CIDEr alone (the paper's metric;
pycocoevalcap's Cider on the PTB tokenizer's output redone in Python: no Java, and without the slow METEOR run). Raw scale (x100 for Table 10), on the videos that have references (the VATEX public test
has none: then only the predictions are written). Files: the metrics JSON and, beside it,
``<metrics stem>.video_caption_predictions.json`` ([{"image_id": video id, "caption"}], the COCO results format).
"""
from __future__ import annotations

import logging

import torch

from mplug_pretrain.errors import DataError
from mplug_pretrain.tasks.evaluation import (
    SkipReport,
    beside_metrics,
    eval_autocast,
    load_eval_model,
    metrics_path,
    write_metrics,
)
from mplug_pretrain.tasks.video import encoding
from mplug_pretrain.tasks.video.retrieval import read_caption_annotations

log = logging.getLogger(__name__)


@torch.no_grad()
def caption_videos(model, tokenizer, cfg, encoded) -> tuple[dict[str, str], dict[str, list[str]]]:
    """-> ({video id: generated caption}, {video id: reference captions}) for every encoded video
    (the decoder's weights packed once for the pass where that applies: models.packed_decoding)."""
    from mplug_pretrain.data.tokenizer import tokenize
    from mplug_pretrain.models.generation.packed_decoding import packed_for_decoding
    from mplug_pretrain.models.inference import decode_generated
    e = cfg.eval
    prompt_ids, prompt_mask = tokenize(tokenizer, [e.generation.prompt], e.max_text_len)
    predictions, references = {}, {}
    with packed_for_decoding(model.decoder) as decoder:
        for records, states, _ in encoded:
            b = states.shape[0]
            ids, mask = prompt_ids.to(states.device).expand(b, -1), prompt_mask.to(states.device).expand(b, -1)
            memory, memory_mask = model.memory_from_states(states, None, ids, mask)
            out = e.generation.beam_search(decoder, memory, memory_mask)
            for record, caption in zip(records, decode_generated(tokenizer, out.sequences[:, 0])):
                if record.video_id in predictions:
                    raise DataError(f"video id {record.video_id!r} appears twice in the evaluated set")
                predictions[record.video_id] = caption
                references[record.video_id] = list(record.captions)
    return predictions, references


def run(cfg, checkpoint: str, out: str | None = None) -> dict:
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.metrics.captions import check_java, score_captions, write_caption_results
    e = cfg.eval
    if e.caption_metrics == "coco":
        check_java()  # before encoding and captioning every video, not after
    model = load_eval_model(cfg, checkpoint)
    skipped = SkipReport()
    with eval_autocast(cfg, model):
        records = encoding.video_record_batches(cfg, read_caption_annotations, skipped)
        encoded = encoding.encoded_batches(model, records, encoding.frame_spec(cfg, model), skipped)
        predictions, references = caption_videos(model, load_tokenizer(cfg.data.tokenizer), cfg, encoded)
    if not predictions:
        raise encoding.nothing_evaluated("no video could be captioned", cfg, skipped)
    path = metrics_path(cfg, "video-caption", out)
    predictions_path = beside_metrics(path, "video_caption_predictions.json")
    write_caption_results(predictions, predictions_path)
    scored = {v: c for v, c in predictions.items() if references[v]}
    scored_refs = {v: references[v] for v in scored}
    if not scored:
        scores = {}
        log.warning("video-caption: no reference captions in the input: predictions written, nothing scored")
    else:
        scores = score_captions(scored, scored_refs, e.caption_metrics)
    metrics = {"task": "video-caption", "checkpoint": checkpoint, **scores, "num_videos": len(predictions),
               "num_scored": len(scored), "caption_metrics": e.caption_metrics, **skipped.as_dict("videos"),
               "prompt": e.generation.prompt, "num_frames": e.num_frames, "frame_sampling": e.frame_sampling,
               "beam_size": e.generation.beam_size, "max_length": e.generation.max_length,
               "min_length": e.generation.min_length,
               "predictions": predictions_path}
    write_metrics(path, metrics)
    return metrics
