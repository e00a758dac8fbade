"""`mplug finetune vqa`: generative VQA fine-tuning (mPLUG §5.2.1), with ALBEF/mPLUG's weighted answer loss.

One batch from shard to loss:
  data.pipeline VQA batch: image, question ids/mask [B, T], unique answers per question with weights
  memory = MPLUG.memory(image, question)        text encoder + fusion with the image -> [B, M+T, D]
  every (question q, answer a) pair: the decoder (bert | expansion | acf) reads "[CLS] a [SEP]" over memory[q]
  L = (1/B) * sum_q sum_{a in A(q)} w(q, a) * ( -sum_t log p(a_t | a_<t, memory[q]) )
      w(q, a) = #annotators who answered a / #annotators; the token sum covers the answer and [SEP];
      B counts the real (non-padding) questions (ALBEF/mPLUG: ``(weights * loss).sum() / batch``).
The pretraining heads (ITC, ITM, MLM) take no part and are frozen; ``vqa.freeze`` may freeze the encoders
and the fusion too. The shared loop (train/loop.py) does DeepSpeed, the schedule, checkpoints and
<run_dir>/model; afterwards rank 0 evaluates that model on ``vqa.val_shards`` (tasks/vqa/evaluate.py) into
<run_dir>/metrics.json and the submission JSON.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mplug_pretrain.config import Config
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.errors import DataError
from mplug_pretrain.tasks.finetuning import (
    evaluate_exported_model,
    finetune_image_size,
    freeze_parts,
    freeze_pretraining_heads,
    initial_model,
    periodic_validation,
    with_task_shards,
)
from mplug_pretrain.train.checkpoint import TrainerState
from mplug_pretrain.train.loop import TrainTask, run_training


def answer_pairs(answers: list[list[str]], weights: list[list[float]], is_pad: torch.Tensor | None,
                 question_ids: list) -> tuple[list[int], list[str], list[float]]:
    """Flatten the batch into (question row, answer, weight) pairs; padding rows give none."""
    rows, texts, pair_weights = [], [], []
    for i, (row_answers, row_weights) in enumerate(zip(answers, weights)):
        if is_pad is not None and bool(is_pad[i]):
            continue
        if not row_answers:
            raise DataError(f"question {question_ids[i]!r}: no answers; VQA training shards need annotations")
        rows.extend([i] * len(row_answers))
        texts.extend(row_answers)
        pair_weights.extend(row_weights)
    return rows, texts, pair_weights


def weighted_answer_loss(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor, rows: list[int],
                         answer_ids: torch.Tensor, answer_mask: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """(1/#questions) sum_pairs w * -log p(answer | memory[row]); answers "[CLS] a [SEP]" [P, L], right padded."""
    index = torch.tensor(rows, device=memory.device)
    logits = decoder(answer_ids, answer_mask, memory[index], memory_mask[index]).logits
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), answer_ids[:, 1:], reduction="none")  # [P, L-1]
    per_pair = (nll * answer_mask[:, 1:]).sum(1)
    weight = torch.tensor(weights, dtype=per_pair.dtype, device=per_pair.device)
    return (weight * per_pair).sum() / len(set(rows))


def vqa_answer_loss(model: nn.Module, batch: dict, tokenizer, max_answer_length: int) -> torch.Tensor:
    """The loss of the module docstring for one VQA batch (scalar). ``max_answer_length`` counts [SEP]."""
    memory, memory_mask = model.memory(batch["image"], batch["question_input_ids"], batch["question_attention_mask"])
    rows, texts, weights = answer_pairs(batch["answers"], batch["answer_weights"], batch.get("is_pad"),
                                        batch["question_id"])
    if not rows:  # a batch of padding only: a zero that still reaches the decoder, so every rank steps alike
        bos = batch["question_input_ids"][:1, :1]
        return model.decoder(bos, torch.ones_like(bos), memory[:1], memory_mask[:1]).logits.sum() * 0.0
    ids, mask = tokenize(tokenizer, texts, max_answer_length + 1)
    return weighted_answer_loss(model.decoder, memory, memory_mask, rows, ids.to(memory.device),
                                mask.to(memory.device), weights)


def training_image_size(cfg: Config) -> int:
    """The training resolution: vqa.image_size, else the pretrained model's, else model.vision.image_size."""
    return finetune_image_size(cfg, cfg.vqa.image_size)


def build_model(cfg: Config) -> nn.Module:
    model = initial_model(cfg, "vqa", cfg.vqa.image_size)
    return freeze_parts(freeze_pretraining_heads(model), cfg.vqa.freeze)


def make_loader_builder(tokenizer):
    def make_loader(cfg: Config, spec: LoaderSpec):
        from mplug_pretrain.data.formats.samples import VQAFormat
        from mplug_pretrain.data.reading.pipeline import build_loader
        from mplug_pretrain.data.transforms import build_eval_transform, build_train_transform
        size = training_image_size(cfg)
        transform = build_train_transform(size) if cfg.vqa.augment else build_eval_transform(size)
        return build_loader(spec, VQAFormat(transform, tokenizer, cfg.data.max_text_len, size))
    return make_loader


def run(cfg: Config, resume: str | None = None) -> dict:
    """Fine-tune, then evaluate the final model on vqa.val_shards (if set).
    -> {"summary": training summary, "metrics": evaluation metrics or {}}."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    cfg = with_task_shards(cfg, "vqa", "vqa", "VQA shards with answers")
    tokenizer = load_tokenizer(cfg.data.tokenizer)

    def losses(engine, batch: dict, state: TrainerState) -> dict:
        return {"loss": vqa_answer_loss(engine.module, batch, tokenizer, cfg.vqa.generation.max_length)}

    def held_out(module, cfg: Config, out: str) -> dict:
        from mplug_pretrain.tasks.vqa.evaluate import evaluate_model
        # the submission beside the val metrics: vqa.submission is the final model's
        return evaluate_model(module, dataclasses.replace(cfg, vqa=dataclasses.replace(cfg.vqa, submission=None)),
                              tokenizer, out)

    task = TrainTask(name="vqa", build_model=build_model, make_loader=make_loader_builder(tokenizer), losses=losses,
                     validate=periodic_validation(cfg, "vqa", held_out), best_metric="val_vqa_accuracy")
    result = run_training(cfg, task, resume=resume)
    summary = result["summary"]
    metrics: dict = {}
    if summary["exit"] == "finished" and cfg.vqa.val_shards:
        from mplug_pretrain.tasks.vqa.evaluate import evaluate_model
        metrics = evaluate_exported_model(cfg, tokenizer, evaluate_model)
    return {"summary": summary, "metrics": metrics}

