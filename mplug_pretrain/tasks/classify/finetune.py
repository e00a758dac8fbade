"""`mplug finetune snli-ve|nlvr2`: a classifier on the fused text [CLS] (models/heads/classifier.py).

    batch: images [B, I, 3, H, W], statement ids / mask [B, T], label [B] (-1 for fillers)
    L = cross-entropy(MPLUG.classify(images, statement), label), mean over the real examples
From ``init_from`` (a pretrained or converted model folder) a new classifier is attached (BERT init); the
pretraining heads and the decoder take no part and are frozen, ``<section>.freeze`` may freeze encoders and
fusion too. The shared loop (train/loop.py) trains; rank 0 then evaluates <run_dir>/model on
``<section>.val_shards`` (tasks/classify/evaluate.py) into <run_dir>/metrics.json.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from mplug_pretrain.config import Config
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.tasks.classify.data import TASKS, ClassificationTask
from mplug_pretrain.tasks.finetuning import (
    finetune_image_size,
    freeze_parts,
    freeze_pretraining_heads,
    initial_model,
    periodic_validation,
    with_task_shards,
)
from mplug_pretrain.train.checkpoint import TrainerState
from mplug_pretrain.train.loop import TrainTask, run_training


def classification_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean cross-entropy over the real examples (fillers carry label -1); a batch of fillers gives 0."""
    logits = model.classify(batch["images"], batch["input_ids"], batch["attention_mask"])
    label = batch["label"].to(logits.device)
    total = F.cross_entropy(logits, label.clamp_min(0), reduction="none")
    return (total * (label >= 0)).sum() / (label >= 0).sum().clamp_min(1)


def build_model(cfg: Config, task: ClassificationTask) -> nn.Module:
    section = getattr(cfg, task.section)
    model = initial_model(cfg, task.section, section.image_size)
    heads = model.config.heads
    if model.classifier is None:
        model.add_classifier(len(task.labels), task.images)
    elif (heads.classifier_classes, heads.classifier_images) != (len(task.labels), task.images):
        raise ConfigError(f"init_from {cfg.init_from}: its classifier has {heads.classifier_classes} classes over "
                          f"{heads.classifier_images} image(s); {task.name} needs {len(task.labels)} over {task.images}")
    model.decoder.requires_grad_(False)
    return freeze_parts(freeze_pretraining_heads(model), section.freeze)


def run(cfg: Config, resume: str | None = None, task: str = "snli-ve") -> dict:
    """Fine-tune, then evaluate the final model on <section>.val_shards (if set) -> {"summary", "metrics"}."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.tasks.classify.evaluate import classification_loader
    spec = TASKS[task]
    section = getattr(cfg, spec.section)
    cfg = with_task_shards(cfg, spec.section, task, f"`mplug make-shards {task}` writes them")
    tokenizer = load_tokenizer(cfg.data.tokenizer)

    def make_loader(cfg: Config, loader_spec: LoaderSpec):
        size = finetune_image_size(cfg, section.image_size)
        return classification_loader(cfg, spec, tokenizer, size, loader_spec)

    def losses(engine, batch: dict, state: TrainerState) -> dict:
        return {"loss": classification_loss(engine.module, batch)}

    def held_out(module, cfg: Config, out: str) -> dict:
        from mplug_pretrain.tasks.classify.evaluate import evaluate_model
        return evaluate_model(module, cfg, spec, tokenizer, out)

    train_task = TrainTask(name=task, build_model=lambda c: build_model(c, spec), make_loader=make_loader,
                           losses=losses, validate=periodic_validation(cfg, spec.section, held_out),
                           best_metric="val_accuracy")
    summary = run_training(cfg, train_task, resume=resume)["summary"]
    metrics: dict = {}
    if summary["exit"] == "finished" and section.val_shards:
        metrics = _evaluate_final_model(cfg, spec, tokenizer)
    return {"summary": summary, "metrics": metrics}


def _evaluate_final_model(cfg: Config, spec: ClassificationTask, tokenizer) -> dict:
    from mplug_pretrain.models.mplug import MPLUG
    from mplug_pretrain.tasks.classify.evaluate import evaluate_model
    from mplug_pretrain.utils.process_group import barrier, rank
    metrics: dict = {}
    if rank() == 0:
        model_dir = os.path.join(cfg.run_dir, "model")
        metrics = evaluate_model(MPLUG.from_pretrained(model_dir), cfg, spec, tokenizer,
                                 os.path.join(cfg.run_dir, "metrics.json"), checkpoint=model_dir)
    barrier()
    return metrics
