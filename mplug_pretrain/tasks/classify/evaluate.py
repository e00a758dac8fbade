"""`mplug eval snli-ve|nlvr2`: classify the examples of ``<section>.val_shards`` with a model folder, score, write files.

    images, statement -> MPLUG.classify (heads/classifier.py) -> argmax class
    accuracy         share of examples whose argmax is the gold label; per-label accuracy beside it, and the
                     majority-label baseline of the evaluated examples (what a constant answer would score)
    files            the metrics JSON (``out`` | eval.output | <run_dir>/metrics_<task>.json) and the predictions
                     [{"key", "sentence", "label", "prediction"}] beside it (<metrics stem>.predictions.json)
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter

import torch
from torch import nn

from mplug_pretrain.config import Config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.tasks.classify.data import TASKS, ClassificationFormat, ClassificationTask
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


def classification_loader(cfg: Config, task: ClassificationTask, tokenizer, image_size: int, spec):
    """The task's shards as ``spec`` says; training augmentation only when ``spec`` shuffles (training)."""
    from mplug_pretrain.data.reading.pipeline import build_loader
    from mplug_pretrain.data.transforms import build_eval_transform, build_train_transform
    augment = getattr(cfg, task.section).augment and spec.shuffle
    transform = build_train_transform(image_size) if augment else build_eval_transform(image_size)
    return build_loader(spec, ClassificationFormat(transform, tokenizer, cfg.data.max_text_len, image_size,
                                                   task.labels, task.images))


@torch.no_grad()
def predict(model: nn.Module, loader, device: torch.device, autocast=None) -> list[dict]:
    """-> one record per real example: key, sentence, label (gold class id), prediction (class id)."""
    records = []
    for batch in loader:
        keep, rows = real_rows(batch)
        if not keep:
            continue
        with autocast or contextlib.nullcontext():
            logits = model.classify(batch["images"][rows].to(device), batch["input_ids"][rows].to(device),
                                    batch["attention_mask"][rows].to(device))
        for i, prediction in zip(keep, logits.argmax(-1).tolist()):
            records.append({"key": batch["__key__"][i], "sentence": batch["sentence"][i],
                            "label": int(batch["label"][i]), "prediction": prediction})
    return records


def score(records: list[dict], labels: tuple[str, ...]) -> dict:
    """Accuracy (percent), per-label accuracy and the majority-label baseline."""
    if not records:
        return {"accuracy": None, "num_examples": 0}
    correct = [r["prediction"] == r["label"] for r in records]
    by_label = {name: [c for c, r in zip(correct, records) if r["label"] == j] for j, name in enumerate(labels)}
    majority = Counter(r["label"] for r in records).most_common(1)[0][1]
    return {"accuracy": 100.0 * sum(correct) / len(records), "num_examples": len(records),
            "per_label_accuracy": {k: 100.0 * sum(v) / len(v) for k, v in by_label.items() if v},
            "majority_baseline": 100.0 * majority / len(records)}


def evaluate_model(model: nn.Module, cfg: Config, task: ClassificationTask, tokenizer, out: str,
                   checkpoint: str | None = None) -> dict:
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    section = getattr(cfg, task.section)
    require_inputs(task.name, cfg)
    if model.classifier is None or model.config.heads.classifier_classes != len(task.labels):
        raise ConfigError(f"--checkpoint {checkpoint}: no {task.name} classifier ({len(task.labels)} classes); "
                          f"evaluate a model fine-tuned by `mplug finetune {task.name}`")
    device = eval_device()
    model = model.to(device).eval()
    spec = LoaderSpec.evaluation(section.val_shards, cfg.eval.batch_size, cfg.data.num_workers, rank=0, world_size=1)
    loader = classification_loader(cfg, task, tokenizer, model.config.vision.image_size, spec)
    start = time.time()
    records = predict(model, loader, device, eval_autocast(cfg, model))
    seconds = time.time() - start
    predictions = beside_metrics(out, "predictions.json")
    write_metrics(predictions, [{**r, "label": task.labels[r["label"]], "prediction": task.labels[r["prediction"]]}
                                for r in records])
    metrics = {"task": task.name, **score(records, task.labels), "examples_per_s": len(records) / max(seconds, 1e-9),
               "predictions": predictions, "checkpoint": checkpoint, "shards": section.val_shards}
    write_metrics(out, metrics)
    return metrics


def run(cfg: Config, checkpoint: str, out: str | None = None, task: str = "snli-ve") -> dict:
    """`mplug eval snli-ve|nlvr2 --checkpoint DIR`."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    spec = TASKS[task]
    model = load_eval_model(cfg, checkpoint)
    return evaluate_model(model, cfg, spec, load_tokenizer(cfg.data.tokenizer), metrics_path(cfg, task, out),
                          checkpoint=checkpoint)
