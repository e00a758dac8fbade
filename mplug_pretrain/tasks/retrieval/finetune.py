"""`mplug finetune retrieval`: image-text retrieval fine-tuning (mPLUG §5.2.3: "we jointly optimize the ITC loss and
the ITM loss", as ALBEF).

    batch (pair layout): image [B, 3, H, W], caption ids / mask [B, T], image_id [B]
    L = ITC (in-batch + momentum queues; every pair whose image ids agree is a positive, queued ones included, so
        the other captions of an image are never negatives; momentum distillation) + ITM (hard negatives drawn
        from the ITC similarities, never an image's own captions)
The pretraining forward (MPLUG.forward) runs with loss weights itc 1, itm 1, mlm 0, prefixlm 0; the fine-tuned
folder keeps those weights in its config.json. The MLM head and the decoder take no part and are frozen. After
training rank 0 evaluates <run_dir>/model on ``retrieval.val_shards`` (ITC top-``eval.k_test`` re-ranked by ITM,
tasks/retrieval/evaluate.py) into <run_dir>/metrics.json.
"""
from __future__ import annotations

import dataclasses
import os

from torch import nn

from mplug_pretrain.config import Config
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.tasks.finetuning import (
    finetune_image_size,
    initial_model,
    periodic_validation,
    with_task_shards,
)
from mplug_pretrain.train.checkpoint import TrainerState
from mplug_pretrain.train.loop import TrainTask, run_training
from mplug_pretrain.train.schedule import distill_alpha

RETRIEVAL_LOSS_WEIGHTS = {"itc": 1.0, "itm": 1.0, "mlm": 0.0, "prefixlm": 0.0}


def build_model(cfg: Config) -> nn.Module:
    model = initial_model(cfg, "retrieval", cfg.retrieval.image_size)
    model.config.heads.loss_weights = dict(RETRIEVAL_LOSS_WEIGHTS)
    for unused in (model.mlm_head, model.decoder):
        unused.requires_grad_(False)
    return model


def run(cfg: Config, resume: str | None = None) -> dict:
    """Fine-tune, then evaluate on retrieval.val_shards (if set) -> {"summary", "metrics"}."""
    from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
    from mplug_pretrain.data.tokenizer import load_tokenizer
    r = cfg.retrieval
    cfg = with_task_shards(cfg, "retrieval", "retrieval", "pair-layout shards: `mplug make-shards coco --layout pair ...`")
    tokenizer = load_tokenizer(cfg.data.tokenizer)

    def make_loader(cfg: Config, spec: LoaderSpec):
        return build_pretrain_loader(spec, tokenizer, image_size=finetune_image_size(cfg, r.image_size),
                                     max_text_len=cfg.data.max_text_len, augment=r.augment, uint8_images=True)

    def losses(engine, batch: dict, state: TrainerState) -> dict:
        out = engine(batch, alpha=distill_alpha(cfg, state.global_step))
        return {key: out[key] for key in ("loss", "loss_itc", "loss_itm")}

    task = TrainTask(name="retrieval", build_model=build_model, make_loader=make_loader, losses=losses,
                     validate=periodic_validation(cfg, "retrieval", _held_out), best_metric="val_r_mean")
    summary = run_training(cfg, task, resume=resume)["summary"]
    metrics: dict = {}
    if summary["exit"] == "finished" and r.val_shards:
        metrics = _evaluate_final_model(cfg)
    return {"summary": summary, "metrics": metrics}


def _val_config(cfg: Config) -> Config:
    """``cfg`` whose eval.* names retrieval.val_shards (at the model's own resolution)."""
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, shards=cfg.retrieval.val_shards,
                                                             annotations=None, image_size=None))


def _held_out(module, cfg: Config, out: str) -> dict:
    """retrieval.val_shards metrics of the live model (the ITC top-k re-ranked by ITM, as after training)."""
    from mplug_pretrain.tasks.evaluation import write_metrics
    from mplug_pretrain.tasks.retrieval.evaluate import evaluate
    metrics = evaluate(_val_config(cfg), module)
    write_metrics(out, metrics)
    return metrics


def _evaluate_final_model(cfg: Config) -> dict:
    from mplug_pretrain.tasks.evaluation import load_eval_model, write_metrics
    from mplug_pretrain.tasks.retrieval.evaluate import evaluate
    from mplug_pretrain.utils.process_group import barrier, rank
    metrics: dict = {}
    if rank() == 0:
        model_dir = os.path.join(cfg.run_dir, "model")
        eval_cfg = _val_config(cfg)
        metrics = {**evaluate(eval_cfg, load_eval_model(eval_cfg, model_dir)), "checkpoint": model_dir}
        write_metrics(os.path.join(cfg.run_dir, "metrics.json"), metrics)
    barrier()
    return metrics
