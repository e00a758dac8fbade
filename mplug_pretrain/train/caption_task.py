"""`mplug finetune caption`: COCO-style caption fine-tuning in stages (mPLUG §5.2.2: cross-entropy, then CIDEr
optimisation; ExpansionNet v2 §IV-A: the fast recipe A-D with a frozen, cached backbone).

One batch from shard to loss:
  shards (pair layout) -> text = "<prompt> <clean caption>", tokenized "[CLS] a picture of c_1..c_n [SEP]";
      image (eval transform, or train augmentation when caption.augment) or, in cached stages, the image's
      cached ViT features (train/feature_cache.py)
  visual states V: encode_image(image) | ViT under no_grad + projection/refiner (freeze_vision) |
      projection/refiner(cached features)
  xe    memory = fuse(V, "[CLS] a picture of [SEP]"); the decoder reads "[CLS] c_1..c_n" and predicts
        "c_1..c_n [SEP]": token-mean cross-entropy (optional label smoothing), as MPLUG.caption_loss
  scst  one row per distinct image; k samples from the decoder over that memory; CIDEr-D reward against the
        image's training references with the leave-one-out baseline; dropout off (train/scst.py)
Padding rows (is_pad) take no part. Stages run in order, each a ``run_training`` call (DeepSpeed, schedule,
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
import tarfile
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from mplug_pretrain.config import Config, StageConfig
from mplug_pretrain.data.caption_text import clean_caption
from mplug_pretrain.data.formats import ImageTextFormat, image_id_of
from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.errors import ConfigError, DataError
from mplug_pretrain.models.heads.prefix_lm import prefix_lm_loss, split_prefix
from mplug_pretrain.models.model_config import ModelConfig
from mplug_pretrain.train.checkpoint import TrainerState
from mplug_pretrain.train.feature_cache import states_from_vit_tokens
from mplug_pretrain.train.loop import TrainTask, run_training, seed_everything
from mplug_pretrain.train.scst import CiderDReward, policy_mode, scst_loss

STAGE_DONE = "stage_done.json"


# ----------------------------------------------------------------- model
def training_image_size(cfg: Config) -> int:
    """caption.image_size, else the pretrained model's, else model.vision.image_size."""
    if cfg.caption.image_size is not None:
        return cfg.caption.image_size
    if cfg.init_from:
        with open(os.path.join(cfg.init_from, "config.json")) as f:
            return int(json.load(f)["vision"]["image_size"])
    return cfg.model.vision.image_size


def _captioner(config: ModelConfig, state: dict | None = None) -> nn.Module:
    """MPLUG without momentum encoders, pretraining heads frozen; ``state`` loaded where its keys fit."""
    from mplug_pretrain.models.mplug import MPLUG
    config = copy.deepcopy(config)
    config.heads.use_momentum = False
    model = MPLUG(config)
    if state is not None:
        own = model.state_dict()
        missing = [k for k in own if k not in state]
        fresh = ("decoder.", "image_encoder.refiner.")
        if any(not k.startswith(fresh) for k in missing):
            raise ConfigError(f"init_from: the pretrained weights lack {missing[0]}")
        model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    for head in (model.itc, model.itm_head, model.mlm_head):
        head.requires_grad_(False)
    return model


def load_caption_model(directory: str, model_cfg: ModelConfig, image_size: int | None = None) -> nn.Module:
    """A captioner from a ``save_pretrained`` folder. The folder's architecture is kept, except that a
    different ``model_cfg.decoder.type`` / ``refiner.type`` swaps in a freshly initialised head of that
    type (the interchangeable decoders: bert | expansion | acf)."""
    from mplug_pretrain.models.mplug import MPLUG
    pretrained = MPLUG.from_pretrained(directory, image_size=image_size)
    config = copy.deepcopy(pretrained.config)
    state = pretrained.state_dict()
    if model_cfg.decoder.type != config.decoder.type:
        config.decoder = copy.deepcopy(model_cfg.decoder)
        state = {k: v for k, v in state.items() if not k.startswith("decoder.")}
    if model_cfg.refiner.type != config.refiner.type:
        config.refiner = copy.deepcopy(model_cfg.refiner)
        state = {k: v for k, v in state.items() if not k.startswith("image_encoder.refiner.")}
    del pretrained
    return _captioner(config, state)


# ----------------------------------------------------------------- data
class CaptionText:
    """Raw caption -> training text "<prompt> <caption>" (caption cleaned when ``clean``)."""

    def __init__(self, prompt: str, clean: bool = True):
        self.prompt, self.clean = prompt.strip(), clean

    def __call__(self, caption: str) -> str:
        caption = clean_caption(caption) if self.clean else caption.strip()
        return f"{self.prompt} {caption}".strip()


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """"[CLS] prompt [SEP]" ids [1, P]."""
    return tokenize(tokenizer, [prompt], 512)[0]


class CaptionImageFormat(ImageTextFormat):
    """``ImageTextFormat`` with the training text built by ``text_fn`` (prompt + cleaned caption)."""

    def __init__(self, transform, tokenizer, max_text_len: int, image_size: int, text_fn: Callable[[str], str]):
        super().__init__(transform, tokenizer, max_text_len, image_size)
        self.text_fn = text_fn

    def decode(self, sample: dict, seed: int) -> dict:
        out = super().decode(sample, seed)
        out["text"] = self.text_fn(out["text"])
        return out

    def blank(self) -> dict:
        return {**super().blank(), "text": self.text_fn("")}


def _tar_samples(url: str):
    """(key, {ext: bytes}) of a tar's txt/json members, grouped like webdataset (key = name up to the first dot)."""
    current, fields = None, {}
    with tarfile.open(url, "r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            folder, base = os.path.split(member.name)
            key, _, ext = base.partition(".")
            key = os.path.join(folder, key) if folder else key
            if key != current:
                if current is not None:
                    yield current, fields
                current, fields = key, {}
            if ext in ("txt", "json"):
                fields[ext] = tar.extractfile(member).read()
    if current is not None:
        yield current, fields


def load_references(cfg: Config) -> dict[int, list[str]]:
    """Training references {image_id: [captions]} for the SCST reward and its document frequencies:
    caption.coco_json (Karpathy train + restval), else a scan of caption.train_shards' txt/json (no image
    is decoded; ids as the loader computes them)."""
    c = cfg.caption
    if c.coco_json:
        from mplug_pretrain.data.write_coco import load_caption_json
        images = load_caption_json(c.coco_json, c.image_root or "", "train,restval")
        return {img.image_id: list(img.captions) for img in images}
    from mplug_pretrain.data.image_decode import SampleError, decode_json, decode_text
    from mplug_pretrain.data.urls import all_shards, expand_sources
    refs: dict[int, list[str]] = {}
    for url in all_shards(expand_sources(c.train_shards)):
        for key, fields in _tar_samples(url):
            try:
                meta = decode_json(fields.get("json"))
                captions = [str(x) for x in meta.get("captions", [])] or [decode_text(fields.get("txt"))]
            except SampleError:
                continue  # the loader skips this sample too
            refs.setdefault(image_id_of(meta, {"__key__": key, "__url__": url}), []).extend(captions)
    if not refs:
        raise DataError(f"caption.train_shards: no caption found in {c.train_shards}")
    return refs


# ----------------------------------------------------------------- losses
def real_rows(batch: dict) -> list[int]:
    """Indices of the non-padding rows."""
    return [i for i, pad in enumerate(batch["is_pad"].tolist()) if not pad]


def visual_states(module: nn.Module, batch: dict, rows: list[int], freeze_vision: bool) -> torch.Tensor:
    """Visual states [len(rows), 1+M, D] from cached features, a frozen ViT or the full image encoder."""
    if "features" in batch:
        return states_from_vit_tokens(module.image_encoder, batch["features"][rows])
    if freeze_vision:
        with torch.no_grad():
            tokens = module.image_encoder.vit(batch["image"][rows])
        return states_from_vit_tokens(module.image_encoder, tokens)
    return module.encode_image(batch["image"][rows])


def caption_xe_loss(module: nn.Module, image_states: torch.Tensor, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, prompt_length: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """MPLUG.caption_loss from given visual states (``prompt_length`` counts [CLS] + prompt tokens)."""
    split = split_prefix(input_ids, attention_mask, split=torch.tensor(prompt_length - 1))
    memory, memory_mask = module.memory_from_states(image_states, None, split.prefix_ids, split.prefix_mask)
    logits = module.decoder(split.target_ids, split.target_mask, memory, memory_mask).logits
    return prefix_lm_loss(logits, split.target_ids, split.target_mask, label_smoothing)


def _rows_or_zero(batch: dict) -> tuple[list[int], float]:
    """The real rows with weight 1, or (a batch of padding only) row 0 with weight 0 so every rank steps alike."""
    rows = real_rows(batch)
    return (rows, 1.0) if rows else ([0], 0.0)


def xe_batch_loss(module: nn.Module, batch: dict, freeze_vision: bool, prompt_length: int,
                  label_smoothing: float) -> dict:
    rows, weight = _rows_or_zero(batch)
    states = visual_states(module, batch, rows, freeze_vision)
    loss = caption_xe_loss(module, states, batch["input_ids"][rows], batch["attention_mask"][rows], prompt_length,
                           label_smoothing)
    return {"loss": loss * weight}


def scst_batch_loss(module: nn.Module, batch: dict, freeze_vision: bool, prompt: torch.Tensor,
                    reward: CiderDReward, tokenizer, k: int, max_length: int) -> dict:
    rows, weight = _rows_or_zero(batch)
    first: dict[int, int] = {}
    for i in rows:  # SCST is image-wise: one row per distinct image of the batch
        first.setdefault(int(batch["image_id"][i]), i)
    rows = list(first.values())
    with policy_mode(module):  # dropout off: the sampler and the log-prob recomputation are one network
        states = visual_states(module, batch, rows, freeze_vision)
        ids = prompt.to(states.device).expand(len(rows), -1)
        memory, memory_mask = module.memory_from_states(states, None, ids, torch.ones_like(ids))
        out = scst_loss(module.decoder, memory, memory_mask, list(first), reward, tokenizer, k=k,
                        max_length=max_length)
    return {"loss": out["loss"] * weight, "loss_reward": out["loss_reward"]}


# ----------------------------------------------------------------- stages
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
    data = dataclasses.replace(d, train_shards=cfg.caption.train_shards, batch_size=stage.batch_size or d.batch_size)
    run = dataclasses.replace(cfg.run, output_dir=cfg.run_dir, name=f"{index + 1}_{stage.name}",
                              seed=cfg.run.seed + index)
    return dataclasses.replace(cfg, optim=optim, data=data, run=run, init_from=init_from)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _random_init(cfg: Config, image_size: int) -> str:
    """No init_from: one seeded random captioner saved to <run dir>/0_init/model, shared by every stage."""
    folder = os.path.join(cfg.run_dir, "0_init", "model")
    if _rank() == 0 and not os.path.isfile(os.path.join(folder, "model.safetensors")):
        seed_everything(cfg.run.seed)
        model_cfg = copy.deepcopy(cfg.model)
        model_cfg.vision.image_size = image_size
        _captioner(model_cfg).save_pretrained(folder)
    _barrier()
    return folder


class CaptionStage:
    """The TrainTask of one stage (model, loader, losses) plus its feature cache."""

    def __init__(self, cfg: Config, stage: StageConfig, tokenizer, image_size: int,
                 reward: CiderDReward | None, cache_folder: str | None):
        self.cfg, self.stage, self.tokenizer, self.image_size, self.reward = cfg, stage, tokenizer, image_size, reward
        self.text_fn = CaptionText(cfg.caption.prompt, cfg.caption.clean_captions)
        self.prompt = prompt_ids(tokenizer, cfg.caption.prompt)
        self.cache = None
        if cache_folder is not None:
            from mplug_pretrain.train.feature_cache import FeatureCache
            self.cache = FeatureCache(cache_folder)

    def build_model(self, cfg: Config) -> nn.Module:
        model = load_caption_model(cfg.init_from, cfg.model, self.image_size)
        if self.stage.freeze_vision:
            model.image_encoder.vit.requires_grad_(False)
        return model

    def make_loader(self, cfg: Config, rank: int, world_size: int, epoch: int, start_batch: int):
        from mplug_pretrain.data.pipeline import build_loader
        from mplug_pretrain.data.transforms import build_eval_transform, build_train_transform
        d = cfg.data
        args = {"batch_size": d.batch_size, "num_workers": d.num_workers, "mode": d.mode, "seed": cfg.run.seed,
                "epoch": epoch, "start_batch": start_batch, "shuffle": True, "rank": rank, "world_size": world_size,
                "samples_per_epoch": d.samples_per_epoch, "shuffle_buffer": d.shuffle_buffer}
        if self.cache is not None:
            from mplug_pretrain.train.feature_cache import build_cached_loader
            return build_cached_loader(cfg.caption.train_shards, self.cache, self.tokenizer, self.text_fn,
                                       max_text_len=d.max_text_len, **args)
        transform = (build_train_transform if cfg.caption.augment else build_eval_transform)(self.image_size)
        fmt = CaptionImageFormat(transform, self.tokenizer, d.max_text_len, self.image_size, self.text_fn)
        return build_loader(cfg.caption.train_shards, fmt, **args)

    def losses(self, engine, batch: dict, state: TrainerState) -> dict:
        c = self.cfg.caption
        module = engine.module
        if self.stage.objective == "xe":
            return xe_batch_loss(module, batch, self.stage.freeze_vision, self.prompt.shape[1] - 1, c.label_smoothing)
        return scst_batch_loss(module, batch, self.stage.freeze_vision, self.prompt, self.reward, self.tokenizer,
                               c.scst_samples, c.max_length)

    def task(self) -> TrainTask:
        return TrainTask(name=f"caption_{self.stage.name}", build_model=self.build_model,
                         make_loader=self.make_loader, losses=self.losses)


def _stage_cider(cfg: Config, model_dir: str, tokenizer) -> dict[str, float]:
    """Held-out scores of a stage's model on caption.val_shards (every rank takes its share):
    {"cider_d": beam-search CIDEr-D, "sample_cider_d": mean CIDEr-D of caption.scst_samples sampled captions
    per image, the SCST objective on held-out images (eval/sampled_cider.py)}."""
    from mplug_pretrain.eval.caption_task import (
        GenerationSettings,
        eval_loader,
        fast_cider_d,
        gather_to_all,
        generate_captions,
    )
    from mplug_pretrain.eval.sampled_cider import sampled_cider_d
    from mplug_pretrain.models.mplug import MPLUG
    c = cfg.caption
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = MPLUG.from_pretrained(model_dir).float().to(device).eval()
    size = model.config.vision.image_size
    predictions, references = gather_to_all(*generate_captions(model, eval_loader(c.val_shards, size, cfg),
                                                               tokenizer, GenerationSettings.from_config(cfg),
                                                               device))
    sampled = sampled_cider_d(model, eval_loader(c.val_shards, size, cfg), tokenizer, c.prompt, device,
                              k=c.scst_samples, max_length=c.max_length, seed=cfg.run.seed)
    return {"cider_d": fast_cider_d(predictions, references), "sample_cider_d": sampled}


def _cache_for(stage_cfg: Config, image_size: int) -> str:
    from mplug_pretrain.train.feature_cache import build_feature_cache
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
    from mplug_pretrain.eval.caption_task import GenerationSettings
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
        if _rank() == 0:
            GenerationSettings.from_config(cfg).save(model_dir)
        if c.val_shards and c.stage_cider:
            record.update(_stage_cider(cfg, model_dir, tokenizer))
            if _rank() == 0:
                print(f"[caption] stage {index + 1}_{stage.name}: held-out CIDEr-D {record['cider_d']:.4f} (beam), "
                      f"{record['sample_cider_d']:.4f} (mean of sampled captions)", flush=True)
        if _rank() == 0:
            with open(done_path, "w") as f:
                json.dump(record, f, indent=2)
        _barrier()
        stages.append(record)
        init_dir = model_dir
    metrics = _final_metrics(cfg, init_dir, tokenizer, stages)
    return {"summary": summary, "stages": stages, "metrics": metrics, "model_dir": init_dir}


def _final_metrics(cfg: Config, model_dir: str, tokenizer, stages: list[dict]) -> dict:
    """pycocoevalcap metrics of the final model (caption.final_eval) plus every stage's fast CIDEr-D,
    written to <run dir>/metrics.json."""
    from mplug_pretrain.eval.caption_task import evaluate_model
    from mplug_pretrain.models.mplug import MPLUG
    per_stage = {f"{key}_{s['stage']}": s[key] for s in stages for key in ("cider_d", "sample_cider_d") if key in s}
    out = os.path.join(cfg.run_dir, "metrics.json")
    if cfg.caption.val_shards and cfg.caption.final_eval == "coco":
        model = MPLUG.from_pretrained(model_dir).float()
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        return {**evaluate_model(model, cfg, tokenizer, cfg.caption.val_shards, out, checkpoint=model_dir,
                                 extra=per_stage), **per_stage}
    if _rank() == 0:
        with open(out, "w") as f:
            json.dump({**per_stage, "checkpoint": model_dir}, f, indent=2)
    return per_stage
