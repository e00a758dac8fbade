"""`mplug finetune grounding`: the decoder generates the referred object's box as 4 coordinate tokens
(tasks/grounding/model.py), as the official mPLUG grounding code does.

    batch: images [B, 3, S, S], expression ids / mask [B, T], boxes [B, 4] (normalised xywh)
    CE_bt   = cross-entropy of coordinate token t of row b (softmax over the S+1 coordinate tokens, teacher forced)
    l1_giou (official):  w_bt = min(|pred_bt - box_bt|, 5) * (1 - GIoU(pred_b, box_b)), no gradient, pred the
              teacher-forced argmax box;  none:  w_bt = 1
    L       = mean over real rows b and t of w_bt * CE_bt   (is_pad fillers excluded; a batch of fillers gives 0)
From ``init_from`` (a pretrained or converted model folder); the pretraining heads take no part and are frozen,
``grounding.freeze`` may freeze encoders and fusion too. The shared loop (train/loop.py) trains; rank 0 then
evaluates <run_dir>/model on ``grounding.val_shards`` (tasks/grounding/evaluate.py) into <run_dir>/metrics.json.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mplug_pretrain.config import Config
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.metrics.boxes import paired_giou, xywh_to_xyxy
from mplug_pretrain.tasks.finetuning import (
    evaluate_exported_model,
    finetune_image_size,
    freeze_parts,
    freeze_pretraining_heads,
    initial_model,
    periodic_validation,
    with_task_shards,
)
from mplug_pretrain.tasks.grounding.model import CoordinateTokens, teacher_forced_logits
from mplug_pretrain.train.checkpoint import TrainerState
from mplug_pretrain.train.loop import TrainTask, run_training

L1_CLAMP = 5.0  # the official code clamps the L1 weight to [0, 5]


def grounding_loss(model: nn.Module, batch: dict, tokens: CoordinateTokens, weighting: str = "l1_giou") -> torch.Tensor:
    """The module docstring's L for one batch."""
    images, boxes = batch["images"], batch["boxes"].to(batch["images"].device).float()
    logits = teacher_forced_logits(model, images, batch["input_ids"], batch["attention_mask"], boxes, tokens)
    targets = tokens.encode(boxes) - tokens.first_id
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    if weighting == "l1_giou":
        with torch.no_grad():
            predicted = tokens.decode(logits.argmax(-1) + tokens.first_id)
            l1 = (predicted - boxes).abs().clamp(0, L1_CLAMP)
            giou = paired_giou(xywh_to_xyxy(predicted), xywh_to_xyxy(boxes))
        ce = ce * l1 * (1 - giou)[:, None]
    elif weighting != "none":
        raise ConfigError(f"grounding.loss_weighting: {weighting!r} not in l1_giou | none")
    real = ~batch["is_pad"].to(ce.device) if "is_pad" in batch else torch.ones(len(ce), dtype=torch.bool,
                                                                                 device=ce.device)
    return (ce.mean(1) * real).sum() / real.sum().clamp_min(1)


def build_model(cfg: Config) -> nn.Module:
    g = cfg.grounding
    model = initial_model(cfg, "grounding", g.image_size)
    return freeze_parts(freeze_pretraining_heads(model), g.freeze)


def run(cfg: Config, resume: str | None = None) -> dict:
    """Fine-tune, then evaluate the final model on grounding.val_shards (if set) -> {"summary", "metrics"}."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.tasks.grounding.evaluate import grounding_loader
    g = cfg.grounding
    cfg = with_task_shards(cfg, "grounding", "grounding", "`mplug make-shards grounding` writes them")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    size = finetune_image_size(cfg, g.image_size)
    tokens = CoordinateTokens.from_tokenizer(tokenizer, size)  # one bin per pixel of the training resolution

    def make_loader(cfg: Config, loader_spec: LoaderSpec):
        return grounding_loader(cfg, tokenizer, size, loader_spec)

    def losses(engine, batch: dict, state: TrainerState) -> dict:
        return {"loss": grounding_loss(engine.module, batch, tokens, g.loss_weighting)}

    def held_out(module, cfg: Config, out: str) -> dict:
        from mplug_pretrain.tasks.grounding.evaluate import evaluate_model
        return evaluate_model(module, cfg, tokenizer, out)

    task = TrainTask(name="grounding", build_model=build_model, make_loader=make_loader, losses=losses,
                     validate=periodic_validation(cfg, "grounding", held_out), best_metric="val_acc@0.5")
    summary = run_training(cfg, task, resume=resume)["summary"]
    metrics: dict = {}
    if summary["exit"] == "finished" and g.val_shards:
        from mplug_pretrain.tasks.grounding.evaluate import evaluate_model
        metrics = evaluate_exported_model(cfg, tokenizer, evaluate_model)
    return {"summary": summary, "metrics": metrics}

