"""`mplug finetune caption`: COCO-style caption fine-tuning in stages (mPLUG §5.2.2: cross-entropy, then CIDEr
optimisation; ExpansionNet v2 §IV-A: the fast recipe A-D with a frozen, cached backbone).

One batch from shard to loss:
  shards (pair layout) -> text = "<prompt> <clean caption>", tokenized "[CLS] a picture of c_1..c_n [SEP]";
      image (eval transform, or train augmentation when caption.augment) or, in cached stages, the image's
      cached ViT features (tasks/caption/feature_cache.py)
  losses: tasks/caption/losses.py (xe, scst); model: tasks/caption/model.py; text, format and training
      references: tasks/caption/data.py
Stages run in order, each a ``run_training`` call (DeepSpeed, schedule,
checkpoints, log) in <run dir>/<i>_<name>/, initialised from the previous stage's model/ folder; the first
from ``init_from`` (random init saved to <run dir>/0_init/model when there is none).
The captioner drops the momentum encoders and freezes the pretraining heads (ITC, ITM, MLM) it never uses.
With ``--resume``, finished stages (marker stage_done.json) are skipped and the first unfinished one resumes.
After each stage: fast held-out CIDEr-D on caption.val_shards, of beam search and of sampled captions
(``caption.stage_cider``); after the last:
the pycocoevalcap metrics into <run dir>/metrics.json (``caption.final_eval``).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os

import torch
from torch import nn

from mplug_pretrain.config import Config, StageConfig
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.tasks.caption.data import CaptionImageFormat, CaptionText, load_references, prompt_ids
from mplug_pretrain.tasks.caption.losses import scst_batch_loss, xe_batch_loss
from mplug_pretrain.tasks.caption.model import captioner, load_caption_model, training_image_size
from mplug_pretrain.tasks.caption.scst import CiderDReward
from mplug_pretrain.tasks.finetuning import periodic_validation
from mplug_pretrain.train.checkpoint import TrainerState
from mplug_pretrain.train.loop import TrainTask, run_training, seed_everything
from mplug_pretrain.utils.atomic_files import write_json_atomic
from mplug_pretrain.utils.process_group import barrier, rank

STAGE_DONE = "stage_done.json"


def stage_config(cfg: Config, index: int, stage: StageConfig, init_from: str) -> Config:
    """The run config of stage ``index``: its steps, lrs, batch; its sub-folder; its init."""
    o, d = cfg.optim, cfg.data
    lr_rest = stage.lr_rest if stage.lr_rest is not None else o.lr_rest
    lr_vision = stage.lr_vision if stage.lr_vision is not None else o.lr_vision
    min_lr = min(stage.min_lr if stage.min_lr is not None else o.min_lr, lr_rest, lr_vision)
    optim = dataclasses.replace(
        o, max_steps=stage.steps, lr_rest=lr_rest, lr_vision=lr_vision, min_lr=min_lr,
        warmup_steps=stage.warmup_steps if stage.warmup_steps is not None else o.warmup_steps,
        grad_accum_steps=stage.grad_accum_steps or o.grad_accum_steps)
    # the stage reads caption.train_shards (data.train_weights weigh pretraining sources: none here)
    data = dataclasses.replace(d, train_shards=cfg.caption.train_shards, train_weights=None,
                               batch_size=stage.batch_size or d.batch_size)
    run = dataclasses.replace(cfg.run, output_dir=cfg.run_dir, name=f"{index + 1}_{stage.name}",
                              seed=cfg.run.seed + index)
    return dataclasses.replace(cfg, optim=optim, data=data, run=run, init_from=init_from)


def _random_init(cfg: Config, image_size: int) -> str:
    """No init_from: one seeded random captioner saved to <run dir>/0_init/model, shared by every stage."""
    folder = os.path.join(cfg.run_dir, "0_init", "model")
    if rank() == 0 and not os.path.isfile(os.path.join(folder, "model.safetensors")):
        seed_everything(cfg.run.seed)
        model_cfg = copy.deepcopy(cfg.model)
        model_cfg.vision.image_size = image_size
        captioner(model_cfg).save_pretrained(folder)
    barrier()
    return folder


class CaptionStage:
    """The TrainTask of one stage (model, loader, losses) plus its feature cache."""

    def __init__(self, cfg: Config, stage: StageConfig, tokenizer, image_size: int,
                 reward: CiderDReward | None, cache_folder: str | None):
        self.cfg, self.stage, self.tokenizer, self.image_size, self.reward = cfg, stage, tokenizer, image_size, reward
        self.text_fn = CaptionText(cfg.caption.generation.prompt, cfg.caption.clean_captions)
        self.prompt = prompt_ids(tokenizer, cfg.caption.generation.prompt)
        self.cache = None
        if cache_folder is not None:
            from mplug_pretrain.tasks.caption.cached_features import FeatureCache
            self.cache = FeatureCache(cache_folder)

    def build_model(self, cfg: Config) -> nn.Module:
        model = load_caption_model(cfg.init_from, cfg.model, self.image_size)
        if self.stage.freeze_vision:
            model.image_encoder.vit.requires_grad_(False)
        return model

    def make_loader(self, cfg: Config, spec: LoaderSpec):
        from mplug_pretrain.data.reading.pipeline import build_loader
        from mplug_pretrain.data.transforms import build_eval_transform, build_train_transform
        if self.cache is not None:
            from mplug_pretrain.tasks.caption.cached_features import build_cached_loader
            return build_cached_loader(spec, self.cache, self.tokenizer, self.text_fn, cfg.data.max_text_len)
        transform = (build_train_transform if cfg.caption.augment else build_eval_transform)(self.image_size)
        fmt = CaptionImageFormat(transform, self.tokenizer, cfg.data.max_text_len, self.image_size, self.text_fn)
        return build_loader(spec, fmt)

    def losses(self, engine, batch: dict, state: TrainerState) -> dict:
        c = self.cfg.caption
        module = engine.module
        if self.stage.objective == "xe":
            return xe_batch_loss(module, batch, self.stage.freeze_vision, self.prompt.shape[1] - 1, c.label_smoothing)
        return scst_batch_loss(module, batch, self.stage.freeze_vision, self.prompt, self.reward, self.tokenizer,
                               c.scst_samples, c.generation.max_length, c.scst_one_pass)

    def held_out(self, module: nn.Module, cfg: Config, out: str) -> dict:
        """Beam-search CIDEr-D of the live model on the whole of caption.val_shards (``periodic_validation``)."""
        from mplug_pretrain.data.reading.pipeline import build_caption_eval_loader
        from mplug_pretrain.tasks.caption.evaluate import fast_cider_d, generate_captions
        from mplug_pretrain.tasks.evaluation import write_metrics
        c = cfg.caption
        spec = LoaderSpec.evaluation(c.val_shards, cfg.eval.batch_size, cfg.eval.num_workers, rank=0, world_size=1)
        loader = build_caption_eval_loader(spec, image_size=module.config.vision.image_size)
        predictions, references = generate_captions(module, loader, self.tokenizer, c.generation,
                                                    next(module.parameters()).device)
        metrics = {"cider_d": fast_cider_d(predictions, references), "num_images": len(predictions)}
        write_metrics(out, metrics)
        return metrics

    def task(self) -> TrainTask:
        return TrainTask(name=f"caption_{self.stage.name}", build_model=self.build_model,
                         make_loader=self.make_loader, losses=self.losses,
                         validate=periodic_validation(self.cfg, "caption", self.held_out), best_metric="val_cider_d")


def _stage_cider(cfg: Config, model_dir: str, tokenizer) -> dict[str, float]:
    """Held-out scores of a stage's model on caption.val_shards (every rank takes its share):
    {"cider_d": beam-search CIDEr-D, "sample_cider_d": mean CIDEr-D of caption.scst_samples sampled captions
    per image, the SCST objective on held-out images (tasks/caption/sampled_cider.py)}."""
    from mplug_pretrain.models.mplug import MPLUG
    from mplug_pretrain.tasks.caption.evaluate import (
        eval_loader,
        fast_cider_d,
        gather_to_all,
        generate_captions,
    )
    from mplug_pretrain.tasks.caption.sampled_cider import sampled_cider_d
    c = cfg.caption
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = MPLUG.from_pretrained(model_dir).float().to(device).eval()
    size = model.config.vision.image_size
    predictions, references = gather_to_all(*generate_captions(model, eval_loader(c.val_shards, size, cfg),
                                                               tokenizer, c.generation, device))
    sampled = sampled_cider_d(model, eval_loader(c.val_shards, size, cfg), tokenizer, c.generation.prompt, device,
                              k=c.scst_samples, max_length=c.generation.max_length, seed=cfg.run.seed)
    return {"cider_d": fast_cider_d(predictions, references), "sample_cider_d": sampled}


def _cache_for(stage_cfg: Config, image_size: int) -> str:
    from mplug_pretrain.tasks.caption.feature_cache import build_feature_cache
    c = stage_cfg.caption
    model = load_caption_model(stage_cfg.init_from, stage_cfg.model, image_size)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    root = c.feature_cache or os.path.join(os.path.dirname(stage_cfg.run_dir), "feature_cache")
    return build_feature_cache(model, c.train_shards, root, image_size, c.feature_dtype,
                               batch_size=stage_cfg.eval.batch_size, num_workers=stage_cfg.data.num_workers)


def run(cfg: Config, resume: str | None = None) -> dict:
    """Run caption.stages in order. -> {"summary": last stage's, "stages": [per stage], "metrics": final
    metrics (also in <run dir>/metrics.json), "model_dir": the final model folder}."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.train.distributed import init_distributed
    c = cfg.caption
    if not c.train_shards:
        raise ConfigError("caption.train_shards: required by `mplug finetune caption` (image-text shards, "
                          "e.g. `mplug make-shards coco --split train,restval`)")
    init_distributed(cfg.distributed.backend, cfg.distributed.timeout_minutes)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    image_size = training_image_size(cfg)
    reward = None
    if any(stage.objective == "scst" for stage in c.stages):
        reward = CiderDReward(load_references(cfg), sigma=c.scst_sigma, eos_in_reward=c.eos_in_reward)
    init_dir = cfg.init_from or _random_init(cfg, image_size)
    stages, summary, metrics = [], {}, {}
    for index, stage in enumerate(c.stages):
        stage_cfg = stage_config(cfg, index, stage, init_dir)
        model_dir = os.path.join(stage_cfg.run_dir, "model")
        done_path = os.path.join(stage_cfg.run_dir, STAGE_DONE)
        if resume and os.path.isfile(done_path):
            with open(done_path) as f:
                stages.append(json.load(f))
            init_dir = model_dir
            continue
        cache_folder = _cache_for(stage_cfg, image_size) if stage.cached_features else None
        task = CaptionStage(cfg, stage, tokenizer, image_size, reward, cache_folder).task()
        result = run_training(stage_cfg, task, resume="auto" if resume in ("latest", "auto") else resume)
        summary = result["summary"]
        del result
        gc.collect()
        resume = None  # a later stage starts fresh
        if summary["exit"] != "finished":
            return {"summary": summary, "stages": stages, "metrics": {}, "model_dir": None}
        record = {"stage": stage.name, "objective": stage.objective, "steps": summary["global_step"],
                  "model_dir": model_dir}
        if rank() == 0:
            c.generation.save(model_dir)
        if c.val_shards and c.stage_cider:
            record.update(_stage_cider(cfg, model_dir, tokenizer))
            if rank() == 0:
                print(f"[caption] stage {index + 1}_{stage.name}: held-out CIDEr-D {record['cider_d']:.4f} (beam), "
                      f"{record['sample_cider_d']:.4f} (mean of sampled captions)", flush=True)
        if rank() == 0:
            write_json_atomic(done_path, record)
        barrier()
        stages.append(record)
        init_dir = model_dir
    metrics = _final_metrics(cfg, init_dir, tokenizer, stages)
    return {"summary": summary, "stages": stages, "metrics": metrics, "model_dir": init_dir}


def _final_metrics(cfg: Config, model_dir: str, tokenizer, stages: list[dict]) -> dict:
    """pycocoevalcap metrics of the final model (caption.final_eval) plus every stage's fast CIDEr-D,
    written to <run dir>/metrics.json."""
    from mplug_pretrain.models.mplug import MPLUG
    from mplug_pretrain.tasks.caption.evaluate import evaluate_model
    per_stage = {f"{key}_{s['stage']}": s[key] for s in stages for key in ("cider_d", "sample_cider_d") if key in s}
    out = os.path.join(cfg.run_dir, "metrics.json")
    if cfg.caption.val_shards and cfg.caption.final_eval == "coco":
        model = MPLUG.from_pretrained(model_dir).float()
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        return {**evaluate_model(model, cfg, tokenizer, cfg.caption.val_shards, out, checkpoint=model_dir,
                                 extra=per_stage), **per_stage}
    if rank() == 0:
        write_json_atomic(out, {**per_stage, "checkpoint": model_dir})
    return per_stage
