"""`mplug pretrain`: ITC + ITM + MLM + PrefixLM on image-text shards. One batch from shard to loss:
data.pipeline (decode, augment, tokenize) -> MPLUG.forward (models/mplug.py) -> the shared loop
(train/loop.py: DeepSpeed, schedule, momentum update, checkpoints)."""
from __future__ import annotations

from mplug_pretrain.config import Config
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.train.checkpoint import TrainerState
from mplug_pretrain.train.loop import TrainTask, run_training
from mplug_pretrain.train.schedule import distill_alpha


def random_init_problem(cfg: Config) -> str | None:
    """Why pretraining ``cfg`` would start a base/large model from random CLIP or BERT weights (None when it
    would not): the paper's recipe starts from CLIP ViT and BERT-base, and a job of many GPU-days from random
    weights is refused unless ``run.allow_random_init`` says it is meant."""
    m = cfg.model
    if cfg.init_from or m.preset == "tiny" or cfg.run.allow_random_init:
        return None
    vision = m.vision.checkpoint_path or ("pretrained" if m.vision.backbone_pretrained else None)
    random = [name for name, path in (("model.vision.checkpoint_path (CLIP ViT weights)", vision),
                                      ("model.text.bert_checkpoint (a BERT folder)", m.text.bert_checkpoint))
              if path is None]
    if not random:
        return None
    return (f"model.preset {m.preset}: {' and '.join(random)} not set, so pretraining would start from random "
            "weights. Set them (e.g. model.vision.checkpoint_path=ViT-B-16.pt from OpenAI CLIP, "
            "model.text.bert_checkpoint=bert-base-uncased/ with config.json and pytorch_model.bin or "
            "model.safetensors), or init_from=<a model folder>, or run.allow_random_init=true to pretrain from "
            "scratch on purpose")


def build_model(cfg: Config):
    from mplug_pretrain.models.mplug import MPLUG
    if cfg.init_from:
        return MPLUG.from_pretrained(cfg.init_from)
    return MPLUG(cfg.model)


def build_train_loader(cfg: Config, spec: LoaderSpec):
    from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
    from mplug_pretrain.data.tokenizer import load_tokenizer
    return build_pretrain_loader(spec, load_tokenizer(cfg.data.tokenizer), image_size=cfg.model.vision.image_size,
                                 max_text_len=cfg.data.max_text_len, augment=cfg.data.augment, uint8_images=True)


def flops_per_sample(cfg: Config, batch: dict) -> float | None:
    """Model FLOPs of one sample of ``batch`` (train/flops.py; typical MLM/PrefixLM shapes for its text length,
    full queue). None for a model the count does not cover (a refiner, a non-BERT decoder)."""
    from mplug_pretrain.train.flops import TextShapes, pretrain_flops_per_sample
    h = cfg.model.heads
    if cfg.model.vision.backbone != "clip_vit":
        return None  # the count covers our ViT only
    if not all(float(h.loss_weights.get(name, 1.0)) for name in ("itc", "itm", "mlm", "prefixlm")):
        return None  # the count assumes all four losses
    try:
        shapes = TextShapes.typical(int(batch["input_ids"].shape[1]), h.mlm_probability)
        return pretrain_flops_per_sample(cfg.model, shapes, int(batch["input_ids"].shape[0])).total
    except ValueError:
        return None


def run_pretrain(cfg: Config, resume: str | None = None) -> dict:
    if not cfg.data.train_shards:
        raise ConfigError("data.train_shards: required for pretraining (a brace pattern of .tar shards)")
    problem = random_init_problem(cfg)
    if problem:
        raise ConfigError(problem)
    def losses(engine, batch: dict, state: TrainerState) -> dict:
        return engine(batch, alpha=distill_alpha(cfg, state.global_step))  # all four losses, one forward

    def validate(module, cfg: Config) -> dict:
        from mplug_pretrain.data.tokenizer import load_tokenizer
        from mplug_pretrain.tasks.pretrain.validation import validate as held_out_metrics
        return held_out_metrics(module, cfg, load_tokenizer(cfg.data.tokenizer))

    task = TrainTask(name="pretrain", build_model=build_model, make_loader=build_train_loader, losses=losses,
                     flops_per_sample=flops_per_sample, validate=validate if cfg.data.val_shards else None,
                     best_metric="val_itc_r1")
    return run_training(cfg, task, resume=resume)
