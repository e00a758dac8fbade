"""``mplug eval video-qa``: zero-shot video question answering (mPLUG §5.4.2, Table 10: MSRVTT-QA, MSVD-QA).

Input (``cfg.eval``), one of:
  * ``shards``: our video shards, questions in ``json.qa`` [{question, answer}];
  * ``annotations`` + ``video_root``: MSRVTT-QA / MSVD-QA, as released (``test_qa.json``: a list of
    {"video_id": 7010, "question", "answer", "id"}, files via ``video_name_format``, "video{}" for
    MSRVTT; MSVD maps "vid{}" to its clip names through ``video_mapping`` = youtube_mapping.txt) or as
    ALPRO/mPLUG ship them (JSON Lines with "video_id": "video7010": ``video_name_format: "{}"``).
Per question: memory = concat(fuse(video states, question)) of the N frames' tokens (``video_encoding``) and
the question, then the answer by ``eval.qa_inference``:
    rank      ``models/generation/answer_ranking.rank_answers`` over the answer list (``rank_k`` first-token candidates), the
              released mPLUG video-QA protocol; list = ``eval.answer_list`` (JSON list, {answer: label} as
              mPLUG's, or one per line), else the distinct answers of the evaluated questions (a closed set
              that contains every right answer: an easier setting than the training answer list)
    generate  beam search (eval.generation: beam_size, min_length..max_length tokens), the paper's description
Accuracy = % of questions whose prediction equals the answer (stripped, lower-cased; mPLUG compares the
strings exactly), over the answered questions: those of skipped videos are left out (``num_questions``
counts the answered ones, ``videos_skipped`` the videos).
Files: the metrics JSON and ``<its stem>.video_qa_predictions.json`` beside it.
"""
from __future__ import annotations

import json
import logging
from functools import partial

import torch

from mplug_pretrain.errors import ConfigError, DataError
from mplug_pretrain.tasks.evaluation import (
    SkipReport,
    beside_metrics,
    eval_autocast,
    load_eval_model,
    metrics_path,
    write_metrics,
)
from mplug_pretrain.tasks.video.encoding import (
    encoded_batches,
    frame_spec,
    nothing_evaluated,
    video_record_batches,
)

log = logging.getLogger(__name__)

VIDEO_KEYS = ("video_id", "video", "clip_name", "vid")


def load_video_mapping(path: str | None) -> dict[str, str] | None:
    """MSVD ``youtube_mapping.txt`` ("<clip name> vid<N>" per line) -> {"vid<N>": clip name}."""
    if path is None:
        return None
    mapping = {}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2:
                raise DataError(f"{path}:{line_no}: expected '<clip name> <video id>', got {line.strip()!r}")
            mapping[parts[1]] = parts[0]
    return mapping


def read_qa_annotations(path: str, name_format: str = "{}",
                        mapping: dict[str, str] | None = None) -> list[tuple[str, list[str], list[dict]]]:
    """(video file reference, [], [{question, answer}]) per video, in first-appearance order."""
    from mplug_pretrain.data.writers.common import load_records
    records = load_records(path)
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a list of question records (JSON list or JSON Lines)")
    grouped: dict[str, list[dict]] = {}
    for i, record in enumerate(records):
        key = next((k for k in VIDEO_KEYS if isinstance(record, dict) and k in record), None)
        if key is None or "question" not in record or "answer" not in record:
            raise DataError(f"{path}: record {i} needs a video ({' | '.join(VIDEO_KEYS)}), "
                            "'question' and 'answer'")
        ref = name_format.format(record[key])
        if mapping is not None:
            if ref not in mapping:
                raise DataError(f"{path}: record {i}: video {ref!r} is not in eval.video_mapping")
            ref = mapping[ref]
        qa = {"question": str(record["question"]), "answer": str(record["answer"])}
        grouped.setdefault(ref, []).append(qa)
    return [(ref, [], qa) for ref, qa in grouped.items()]


def load_answer_list(path: str) -> list[str]:
    """JSON list, JSON object (mPLUG's {answer: label}: its keys) or one answer per line."""
    if path.endswith(".json"):
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict):
            return [str(a) for a in data]
        if isinstance(data, list):
            return [str(a) for a in data]
        raise DataError(f"{path}: expected a JSON list or object of answers")
    from mplug_pretrain.data.writers.vqa import load_answer_list as load_lines
    return load_lines(path)


def normalize(answer: str) -> str:
    return answer.strip().lower()


def evaluated_answers(cfg, reader) -> list[str]:
    """The distinct answers of the questions in the input, in first-appearance order (no video is decoded)."""
    e = cfg.eval
    if e.annotations is not None:
        entries = reader(e.annotations, e.video_name_format)
        qa_lists = [qa for _, _, qa in entries]
    else:
        from mplug_pretrain.tasks.video.encoding import shard_records
        batches = shard_records(e.shards, e.batch_size, e.num_workers, SkipReport())
        qa_lists = [record.qa for batch in batches for record in batch]
    return list(dict.fromkeys(q["answer"] for qa in qa_lists for q in qa))


class VideoAnswerer:
    """Answers questions about encoded videos: states [Q, L, D] (one row per question) + question tokens."""

    def __init__(self, model, tokenizer, cfg, answer_list: list[str] | None):
        from mplug_pretrain.data.tokenizer import tokenize
        e = cfg.eval
        self.model, self.tokenizer, self.e, self.answer_list = model, tokenizer, e, answer_list
        if e.qa_inference == "rank":
            if not answer_list:
                raise ConfigError("eval.answer_list: `eval.qa_inference: rank` needs answers (none found)")
            self.answer_ids, self.answer_mask = tokenize(tokenizer, answer_list, e.max_text_len)

    @torch.no_grad()
    def __call__(self, video_states: torch.Tensor, questions: list[str],
                 decoder: torch.nn.Module | None = None) -> list[str]:
        """``decoder``: the one generation uses (default ``model.decoder``; ``answer_videos`` packs it)."""
        from mplug_pretrain.data.tokenizer import tokenize
        from mplug_pretrain.models.generation.answer_ranking import rank_answers
        from mplug_pretrain.models.inference import decode_generated
        device = video_states.device
        ids, mask = tokenize(self.tokenizer, questions, self.e.max_text_len)
        ids, mask = ids.to(device), mask.to(device)
        memory, memory_mask = self.model.memory_from_states(video_states, None, ids, mask)
        if self.e.qa_inference == "rank":
            best = rank_answers(self.model, memory, memory_mask, self.answer_ids, self.answer_mask,
                                self.e.rank_k)
            return [self.answer_list[i] for i in best[:, 0].tolist()]
        out = self.e.generation.beam_search(self.model.decoder if decoder is None else decoder, memory, memory_mask)
        return decode_generated(self.tokenizer, out.sequences[:, 0])


def answer_videos(answerer: VideoAnswerer, encoded, batch_size: int) -> tuple[list[dict], int]:
    """-> (one record per answered question, number of videos answered)."""
    from mplug_pretrain.models.generation.packed_decoding import packed_for_decoding
    predictions, videos = [], 0
    with packed_for_decoding(answerer.model.decoder) as decoder:  # weights fixed for the pass
        for records, states, _ in encoded:
            rows = [(b, q) for b, record in enumerate(records) for q in record.qa]
            videos += sum(1 for r in records if r.qa)
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                index = torch.tensor([b for b, _ in chunk], device=states.device)
                answers = answerer(states[index], [q["question"] for _, q in chunk], decoder)
                predictions += [{"video_id": records[b].video_id, "question": q["question"],
                                 "answer": q["answer"], "prediction": a} for (b, q), a in zip(chunk, answers)]
    return predictions, videos


def run(cfg, checkpoint: str, out: str | None = None) -> dict:
    from mplug_pretrain.data.tokenizer import load_tokenizer
    e = cfg.eval
    reader = partial(read_qa_annotations, mapping=load_video_mapping(e.video_mapping))
    if e.answer_list is not None:
        answer_list, list_source = load_answer_list(e.answer_list), e.answer_list
    elif e.qa_inference == "rank":
        answer_list, list_source = evaluated_answers(cfg, reader), "answers of the evaluated questions"
    else:
        answer_list, list_source = None, None
    model = load_eval_model(cfg, checkpoint)
    answerer = VideoAnswerer(model, load_tokenizer(cfg.data.tokenizer), cfg, answer_list)
    skipped = SkipReport()
    with eval_autocast(cfg, model):
        batches = video_record_batches(cfg, reader, skipped)
        encoded = encoded_batches(model, batches, frame_spec(cfg, model), skipped)
        predictions, num_videos = answer_videos(answerer, encoded, e.batch_size)
    if not predictions:
        raise nothing_evaluated("no question could be answered", cfg, skipped)
    correct = sum(normalize(p["prediction"]) == normalize(p["answer"]) for p in predictions)
    path = metrics_path(cfg, "video-qa", out)
    predictions_path = beside_metrics(path, "video_qa_predictions.json")
    write_metrics(predictions_path, predictions)
    metrics = {"task": "video-qa", "checkpoint": checkpoint, "accuracy": 100.0 * correct / len(predictions),
               "num_questions": len(predictions), "num_videos": num_videos, **skipped.as_dict("videos"),
               "inference": e.qa_inference, "num_frames": e.num_frames, "frame_sampling": e.frame_sampling,
               "predictions": predictions_path}
    if e.qa_inference == "rank":
        in_list = {normalize(a) for a in answer_list}
        metrics.update(answer_list=list_source, answer_list_size=len(answer_list), rank_k=e.rank_k,
                       answers_outside_list=sum(normalize(p["answer"]) not in in_list for p in predictions))
    else:
        metrics.update(beam_size=e.generation.beam_size, max_length=e.generation.max_length)
    write_metrics(path, metrics)
    return metrics
