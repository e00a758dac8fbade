"""`mplug eval vqa`: answer the questions of ``vqa.val_shards`` with a model folder, score, write files.

    image, question -> MPLUG.memory (text encoder + fusion) -> the answer, by ``vqa.inference``:
        generate  beam search (vqa.generation: beam_size, length_penalty; at least 1 and at most max_length
                  tokens, [SEP] included), decoded to free text: mPLUG's open-vocabulary answers
        rank      models/generation/answer_ranking.rank_answers over the answer list (vqa.rank_k first-token candidates)
    accuracy  metrics/vqa_accuracy.evaluate_vqa with ``vqa.normalization`` over the questions that have human
              answers (test splits have none: then only the submission is written)
    files     the metrics JSON (``out`` | eval.output | <run_dir>/metrics_vqa.json) and the test-dev
              submission [{"question_id", "answer"}] (vqa.submission | <metrics stem>.vqa_submission.json beside the metrics)
The answer list: ``vqa.answer_list``, else the one the val shards' manifest names (needed by ``rank`` only).
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
from torch import nn

from mplug_pretrain.config import Config
from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.metrics.vqa_accuracy import evaluate_vqa, write_vqa_submission
from mplug_pretrain.models.generation.answer_ranking import rank_answers
from mplug_pretrain.models.generation.packed_decoding import packed_for_decoding
from mplug_pretrain.models.generation.settings import AnswerSettings
from mplug_pretrain.models.inference import decode_generated
from mplug_pretrain.tasks.eval_inputs import require_inputs
from mplug_pretrain.tasks.evaluation import (
    beside_metrics,
    eval_autocast,
    eval_device,
    load_eval_model,
    metrics_path,
    real_rows,
    write_metrics,
)


class AnswerPredictor:
    """Answers a batch of (image, question) by generation or by ranking a fixed answer list."""

    def __init__(self, model: nn.Module, tokenizer, inference: str, settings: AnswerSettings, rank_k: int,
                 answer_list: list[str] | None = None):
        if inference not in ("generate", "rank"):
            raise ConfigError(f"vqa.inference: expected 'generate' or 'rank', got {inference!r}")
        if inference == "rank" and not answer_list:
            raise ConfigError("vqa.answer_list: `vqa.inference: rank` needs an answer list (set vqa.answer_list "
                              "or write the shards with one)")
        self.model, self.tokenizer, self.inference = model, tokenizer, inference
        self.settings, self.rank_k, self.answer_list = settings, rank_k, answer_list
        if inference == "rank":
            self.answer_ids, self.answer_mask = tokenize(tokenizer, answer_list, settings.max_length + 1)

    @torch.no_grad()
    def __call__(self, image: torch.Tensor, question_ids: torch.Tensor, question_mask: torch.Tensor,
                 decoder: nn.Module | None = None) -> list[str]:
        """``decoder``: the one generation uses (default ``model.decoder``; ``answer_questions`` packs it)."""
        memory, memory_mask = self.model.memory(image, question_ids, question_mask)
        if self.inference == "rank":
            best = rank_answers(self.model, memory, memory_mask, self.answer_ids, self.answer_mask, self.rank_k)[:, 0]
            return [self.answer_list[i] for i in best.tolist()]
        out = self.settings.beam_search(self.model.decoder if decoder is None else decoder, memory, memory_mask)
        return decode_generated(self.tokenizer, out.sequences[:, 0])


def answer_questions(predictor: AnswerPredictor, loader, device: torch.device, autocast=None) -> list[dict]:
    """-> one record per real question: question_id, question, answer, all_answers (human answers)."""
    records = []
    with packed_for_decoding(predictor.model.decoder) as decoder:  # weights fixed for the pass
        for batch in loader:
            keep, rows = real_rows(batch)
            if not keep:
                continue
            with autocast or contextlib.nullcontext():
                answers = predictor(batch["image"][rows].to(device), batch["question_input_ids"][rows].to(device),
                                    batch["question_attention_mask"][rows].to(device), decoder)
            for i, answer in zip(keep, answers):
                records.append({"question_id": batch["question_id"][i], "question": batch["question"][i],
                                "answer": answer, "all_answers": batch["all_answers"][i]})
    return records


def score_records(records: list[dict], normalization: str) -> dict:
    """Official accuracy over the records that have human answers; {} when none has (test splits)."""
    gts = {r["question_id"]: r["all_answers"] for r in records if r["all_answers"]}
    if not gts:
        return {}
    predictions = {r["question_id"]: r["answer"] for r in records if r["question_id"] in gts}
    result = evaluate_vqa(predictions, gts, normalization)
    return {"vqa_accuracy": result["overall"], "num_scored": result["num_questions"],
            "normalization": normalization}


def resolve_answer_list(cfg: Config, loader, model_dir: str | None = None) -> list[str] | None:
    """vqa.answer_list, else the list kept in the model folder by its fine-tuning, else the shards' own."""
    from mplug_pretrain.data.writers.vqa import MODEL_ANSWER_LIST, load_answer_list
    if cfg.vqa.answer_list:
        return load_answer_list(cfg.vqa.answer_list)
    if model_dir and os.path.isfile(os.path.join(model_dir, MODEL_ANSWER_LIST)):
        return load_answer_list(os.path.join(model_dir, MODEL_ANSWER_LIST))
    return loader.answer_list


def evaluate_model(model: nn.Module, cfg: Config, tokenizer, out: str, checkpoint: str | None = None) -> dict:
    """Answer vqa.val_shards with ``model``, write the metrics JSON and the submission; -> metrics."""
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_vqa_loader
    v = cfg.vqa
    require_inputs("vqa", cfg)
    device = eval_device()
    model = model.to(device).eval()
    spec = LoaderSpec.evaluation(v.val_shards, cfg.eval.batch_size, cfg.data.num_workers, rank=0, world_size=1)
    loader = build_vqa_loader(spec, tokenizer, image_size=model.config.vision.image_size,
                              max_text_len=cfg.data.max_text_len, augment=False)
    predictor = AnswerPredictor(model, tokenizer, v.inference, v.generation, v.rank_k,
                                resolve_answer_list(cfg, loader, checkpoint))
    start = time.time()
    records = answer_questions(predictor, loader, device, eval_autocast(cfg, model))
    seconds = time.time() - start
    submission = v.submission or beside_metrics(out, "vqa_submission.json")
    write_vqa_submission([{"question_id": r["question_id"], "answer": r["answer"]} for r in records], submission)
    metrics = {"task": "vqa", "inference": v.inference, **score_records(records, v.normalization),
               "num_questions": len(records), "questions_per_s": len(records) / max(seconds, 1e-9),
               "submission": submission, "checkpoint": checkpoint, "shards": v.val_shards}
    if v.inference == "rank":
        metrics["rank_k"] = v.rank_k
    else:
        metrics.update(beam_size=v.generation.beam_size, length_penalty=v.generation.length_penalty)
    write_metrics(out, metrics)
    return metrics


def run(cfg: Config, checkpoint: str, out: str | None = None) -> dict:
    """`mplug eval vqa --checkpoint DIR`: DIR is a model folder (save_pretrained / mplug export / <run>/model)."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    model = load_eval_model(cfg, checkpoint)
    return evaluate_model(model, cfg, load_tokenizer(cfg.data.tokenizer), metrics_path(cfg, "vqa", out),
                          checkpoint=checkpoint)
