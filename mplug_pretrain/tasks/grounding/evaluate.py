"""`mplug eval grounding`: locate the referred object of each example of ``grounding.val_shards`` with a model
folder, score, write files.

    image, expression -> MPLUG memory -> decoder greedily emits 4 coordinate tokens (tasks/grounding/model.py) -> box
    Acc@0.5        share of examples whose box has IoU >= 0.5 with the gold box (metrics/boxes.py); mean IoU
    centre_box     Acc@0.5 of a constant answer: a box centred in the image with the mean width and height of the
                   evaluated gold boxes (what a model ignoring image and text could score)
    files          the metrics JSON (``out`` | eval.output | <run_dir>/metrics_grounding.json) and the predictions
                   [{"key", "ref_id", "text", "box", "prediction", "iou"}] (normalised xywh) beside it
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
from torch import nn

from mplug_pretrain.config import Config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.metrics.boxes import accuracy_at, paired_iou, xywh_to_xyxy
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
from mplug_pretrain.tasks.grounding.model import CoordinateTokens, predict_boxes

IOU_THRESHOLD = 0.5


def grounding_loader(cfg: Config, tokenizer, image_size: int, spec):
    from mplug_pretrain.data.reading.pipeline import build_loader
    from mplug_pretrain.tasks.grounding.data import GroundingFormat
    return build_loader(spec, GroundingFormat(tokenizer, cfg.data.max_text_len, image_size))


@torch.no_grad()
def predict(model: nn.Module, loader, tokens: CoordinateTokens, device: torch.device, autocast=None) -> list[dict]:
    """-> one record per real example: key, ref_id, text, box (gold), prediction (normalised xywh), iou."""
    records = []
    for batch in loader:
        keep, rows = real_rows(batch)
        if not keep:
            continue
        with autocast or contextlib.nullcontext():
            predicted = predict_boxes(model, batch["images"][rows].to(device), batch["input_ids"][rows].to(device),
                                      batch["attention_mask"][rows].to(device), tokens).float().cpu()
        gold = batch["boxes"][rows].float()
        ious = paired_iou(xywh_to_xyxy(predicted), xywh_to_xyxy(gold))
        for j, i in enumerate(keep):
            records.append({"key": batch["__key__"][i], "ref_id": batch["ref_id"][i], "text": batch["text"][i],
                            "box": gold[j].tolist(), "prediction": predicted[j].tolist(), "iou": float(ious[j])})
    return records


def centre_box_baseline(gold: torch.Tensor) -> torch.Tensor:
    """IoUs of the constant answer: the mean gold (w, h), centred in the image; gold normalised xywh [N, 4]."""
    w, h = gold[:, 2].mean(), gold[:, 3].mean()
    box = torch.stack([(1 - w) / 2, (1 - h) / 2, w, h]).expand_as(gold)
    return paired_iou(xywh_to_xyxy(box), xywh_to_xyxy(gold))


def score(records: list[dict]) -> dict:
    """Acc@0.5 (percent), mean IoU and the centre-box baseline, all recomputed from the boxes."""
    if not records:
        return {"acc@0.5": None, "num_examples": 0}
    gold = torch.tensor([r["box"] for r in records])
    ious = paired_iou(xywh_to_xyxy(torch.tensor([r["prediction"] for r in records])), xywh_to_xyxy(gold))
    return {"acc@0.5": accuracy_at(ious, IOU_THRESHOLD), "mean_iou": float(ious.mean()),
            "num_examples": len(records), "centre_box_acc@0.5": accuracy_at(centre_box_baseline(gold), IOU_THRESHOLD)}


def evaluate_model(model: nn.Module, cfg: Config, tokenizer, out: str, checkpoint: str | None = None) -> dict:
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    require_inputs("grounding", cfg)
    device = eval_device()
    model = model.to(device).eval()
    size = model.config.vision.image_size
    tokens = CoordinateTokens.from_tokenizer(tokenizer, size)
    spec = LoaderSpec.evaluation(cfg.grounding.val_shards, cfg.eval.batch_size, cfg.data.num_workers, rank=0,
                                 world_size=1)
    start = time.time()
    records = predict(model, grounding_loader(cfg, tokenizer, size, spec), tokens, device, eval_autocast(cfg, model))
    seconds = time.time() - start
    predictions = beside_metrics(out, "predictions.json")
    write_metrics(predictions, records)
    metrics = {"task": "grounding", **score(records), "coordinate_bins": size,
               "examples_per_s": len(records) / max(seconds, 1e-9), "predictions": predictions,
               "checkpoint": checkpoint, "shards": cfg.grounding.val_shards}
    write_metrics(out, metrics)
    return metrics


def run(cfg: Config, checkpoint: str, out: str | None = None) -> dict:
    """`mplug eval grounding --checkpoint DIR`."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.models.folder.config_io import CONFIG_FILE, read_model_config
    config_file = os.path.join(checkpoint, CONFIG_FILE)
    trained = read_model_config(config_file).vision.image_size if os.path.isfile(config_file) else None
    if cfg.eval.image_size is not None and trained is not None and cfg.eval.image_size != trained:
        raise ConfigError(f"eval.image_size={cfg.eval.image_size}: the model writes boxes in {trained} coordinate bins "
                          f"(its fine-tuning resolution); evaluate grounding at {trained} (leave eval.image_size unset)")
    model = load_eval_model(cfg, checkpoint)
    return evaluate_model(model, cfg, load_tokenizer(cfg.data.tokenizer), metrics_path(cfg, "grounding", out),
                          checkpoint=checkpoint)
