"""Typed run configuration: one resolved YAML describes a run completely.

    load_config("configs/pretrain_tiny.yaml", ["optim.lr_rest=3e-5"]) -> Config

Load order: class defaults <- model preset (``model.preset``) <- YAML file <- overrides.
Everything is validated before work starts; errors name the dotted field (ConfigError).
The DeepSpeed config is derived from this (``deepspeed_config``), never typed twice.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Literal

import yaml

from mplug_pretrain.config_loader import (
    deep_merge,
    find_config,
    parse_overrides,
    resolve_list_indices,
    to_dict,
)
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.generation.settings import AnswerSettings, GenerationSettings
from mplug_pretrain.models.model_config import ModelConfig
from mplug_pretrain.utils.atomic_files import atomic_write
from mplug_pretrain.utils.resources import deepspeed_template
from mplug_pretrain.utils.typed_dataclass import build_dataclass
from mplug_pretrain.utils.value_checks import check_positive

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class DataConfig:
    """Shards: brace patterns; several sources separated by '::' with optional ``train_weights``."""
    train_shards: str | None = None  # required by `mplug pretrain`
    train_weights: list[float] | None = None
    val_shards: str | None = None
    mode: Literal["exact", "resampled"] = "exact"
    samples_per_epoch: int | None = None  # resampled mode: per-epoch sample budget (all ranks)
    batch_size: int = 8  # per rank, per micro-step
    num_workers: int = 2
    max_text_len: int = 30
    shuffle_buffer: int = 1000
    # folder with vocab.txt; default: init_from's / the evaluated folder's own, else the MiniLM package's
    # (bert-base-uncased vocab)
    tokenizer: str | None = None
    augment: bool = True  # pretraining: RandomResizedCrop + RandAugment (ALBEF / mPLUG); off: the eval transform
    # an image with more pixels (header width x height) is skipped before decoding, as too_many_pixels
    max_image_pixels: int = 64 * 2**20


@dataclass
class OptimConfig:
    lr_vision: float = 1e-5
    lr_rest: float = 1e-4
    min_lr: float = 1e-6
    weight_decay: float = 0.02
    betas: tuple[float, ...] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 1000
    max_steps: int = 10000  # optimizer steps; the schedule's length
    grad_accum_steps: int = 1
    grad_clip: float = 1.0
    alpha_warmup_steps: int = 0  # ALBEF ramps distillation alpha from 0 over these steps


@dataclass
class DistributedConfig:
    zero_stage: int = 2
    template: str | None = None  # DeepSpeed JSON template; default deepspeed_configs/zero{stage}.json
    offload_optimizer: bool = False
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on a GPU that has it, else fp32
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_minutes: float = 30.0  # a dead rank fails the job after this instead of hanging it
    # ZeRO 1-2 on a single rank partition nothing: run them as ZeRO-0 (no flat gradient buffer, no all-reduce
    # and copy back of every gradient, one optimizer step over all groups); false keeps the stage as written
    single_rank_zero0: bool = True
    # how `--nproc N` starts its ranks: fork (from the launcher, after it imported torch, DeepSpeed and the model:
    # ~9 CPU-s less per rank; CPU only), exec (fresh interpreters under torchrun), auto (fork without a GPU)
    rank_start: Literal["auto", "fork", "exec"] = "auto"


@dataclass
class RunConfig:
    name: str = "pretrain"
    output_dir: str = "runs"
    seed: int = 42
    log_every: int = 10
    checkpoint_every_steps: int = 1000
    checkpoint_every_minutes: float = 30.0
    keep_last: int = 2  # DeepSpeed tags kept in checkpoints/ (tiny: 173 MB each; docs/configuration.md)
    max_nonfinite_in_row: int = 5
    tensorboard: bool = True  # false turns TensorBoard off whatever report_to says
    plot_losses: bool = True  # plots/losses.png when the run finishes (matplotlib: about a second)
    report_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=lambda: ["tensorboard"])
    wandb_project: str = "mplug_pretrain"  # report_to wandb: the project (WANDB_MODE=offline: local files only)
    wandb_entity: str | None = None
    deterministic: bool = False
    inject_nonfinite_at_steps: list[int] = field(default_factory=list)  # testing aid: NaN loss at these steps
    compile: bool = False  # torch.compile each transformer block, text padded to a multiple of 8 (train/block_compile.py)
    compile_backend: str = "inductor"  # torch.compile backend of run.compile ("aot_eager": capture only, no codegen)
    allow_random_init: bool = False  # pretrain a base/large model without CLIP/BERT weights on purpose
    cpu_peak_flops: float | None = None  # FLOP/s to compute MFU against on CPU (None: no MFU on CPU)
    overwrite: bool = False  # replace a previous run in this folder (without it, a run folder is refused unless resumed)
    discard_newer: bool = False  # --resume <older tag>: delete this run's newer complete tags (else refused)
    # fields a resumed run may change from its checkpoint's config (dotted names or sections, e.g. optim.max_steps);
    # logging, checkpoint cadence and paths may always change (train/config_change.py)
    allow_config_change: list[str] = field(default_factory=list)
    # held-out validation while training (data.val_shards): every N optimizer steps and at the end (0: at the end)
    eval_every_steps: int = 0
    val_batches: int = 0  # per rank and validation; 0: this rank's whole share of data.val_shards
    # kept in <run>/best/ when it improves (*loss* metrics improve downwards); "" = the task's own: pretraining
    # val_itc_r1, caption val_cider_d, vqa val_vqa_accuracy, snli-ve / nlvr2 val_accuracy, grounding val_acc@0.5,
    # retrieval val_r_mean
    best_metric: str = ""
    record_sample_keys: bool = False  # <run>/sample_keys/rank<R>.jsonl: the keys each step trained on (train/sample_keys.py)


@dataclass
class StageConfig:
    """One stage of a caption fine-tuning recipe (ExpansionNet v2 steps A-D are four of these; see
    configs/caption_fast_recipe.yaml). Unset optional fields fall back to data.* / optim.*."""
    name: str = "xe"  # its run sub-folder: <run dir>/<index>_<name>
    objective: Literal["xe", "scst"] = "xe"
    steps: int = 100  # optimizer steps
    freeze_vision: bool = False  # the ViT takes no gradient (projection, refiner, text, fusion, decoder train)
    cached_features: bool = False  # read the frozen ViT's features from the on-disk cache instead of images
    lr_rest: float | None = None  # default: optim.lr_rest
    lr_vision: float | None = None  # default: optim.lr_vision
    min_lr: float | None = None  # default: optim.min_lr; equal to the peak lrs gives a constant lr
    warmup_steps: int | None = None  # default: optim.warmup_steps
    batch_size: int | None = None  # per rank; default: data.batch_size
    grad_accum_steps: int | None = None  # default: optim.grad_accum_steps


@dataclass
class CaptionConfig:
    """`mplug finetune caption` (tasks/caption/finetune.py) and `mplug eval caption` (tasks/caption/evaluate.py)."""
    train_shards: str | None = None  # image-text shards (pair layout: one sample per caption)
    val_shards: str | None = None  # image layout (json.captions = references): evaluated after each stage
    coco_json: str | None = None  # Karpathy dataset_coco.json: SCST references (train + restval) without a shard scan
    image_root: str | None = None
    # the decoding settings (prompt, beam search; models/generation/settings.py): the prompt also leads every
    # training text, max_length also bounds SCST samples; saved as caption_generation.json beside the weights
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    clean_captions: bool = True  # ExpansionNet v2 cleaning (tasks/caption/text.py: "Man's" -> "man s") in training text and rewards
    image_size: int | None = None  # fine-tuning resolution (ViT positions resized); default: init_from's
    augment: bool = False  # RandomResizedCrop + RandAugment in image stages (cached stages read eval-transform features)
    label_smoothing: float = 0.0
    scst_samples: int = 5  # k sampled captions per image; baseline = mean reward of the other k - 1
    scst_sigma: float = 6.0  # CIDEr-D length penalty (n = 4)
    # SCST's log-probs with gradient from the sampling pass itself instead of a teacher-forced recomputation: the
    # same loss and gradient; faster only when the output layer dominates (bench/NOTES.md "SCST in one pass")
    scst_one_pass: bool = False
    eos_in_reward: bool = True  # SacreEOS "standard": EOS kept in sampled captions and references
    feature_cache: str | None = None  # folder for cached frozen visual features; default <run dir>/feature_cache
    feature_dtype: Literal["float32", "float16"] = "float32"
    stage_cider: bool = True  # fast held-out CIDEr-D (no Java) after every stage when val_shards is set
    final_eval: Literal["coco", "none"] = "coco"  # pycocoevalcap metrics of the final model on val_shards
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig()])


VQA_FREEZABLE = ("image_encoder", "text_encoder", "fusion")


@dataclass
class VQAConfig:
    """VQA fine-tuning (tasks/vqa/finetune.py) and evaluation (tasks/vqa/evaluate.py); steps are optim.max_steps."""
    train_shards: str | None = None
    val_shards: str | None = None  # evaluated after fine-tuning and by `mplug eval vqa`
    answer_list: str | None = None  # JSON list or one per line; default: the list the val shards name
    inference: Literal["generate", "rank"] = "generate"
    rank_k: int = 128  # candidates kept by first-token probability before full scoring
    # beam search of answers (models/generation/settings.py); max_length (incl. [SEP]) also truncates training
    # answers; saved as answer_generation.json beside the weights of every training run
    generation: AnswerSettings = field(default_factory=AnswerSettings)
    normalization: Literal["official_2021", "legacy"] = "official_2021"
    image_size: int | None = None  # fine-tuning resolution (ViT positions resized); default: init_from's
    augment: bool = True  # RandomResizedCrop + RandAugment on training images (mPLUG/ALBEF)
    # parts kept frozen (no gradient, eval mode): image_encoder | text_encoder | fusion; [] = mPLUG's full
    # fine-tuning. Freezing all three trains the decoder alone on fixed memories (a fast CPU recipe).
    freeze: list[str] = field(default_factory=list)
    submission: str | None = None  # test-dev results JSON; default: <metrics stem>.vqa_submission.json beside the metrics


@dataclass
class RetrievalFinetuneConfig:
    """`mplug finetune retrieval` (tasks/retrieval/finetune.py): ITC (momentum queues carrying image ids: captions of one
    image are never negatives) + ITM with hard negatives, then `mplug eval retrieval` of the final model."""
    train_shards: str | None = None  # pair layout (one sample per caption, json.image_id shared by an image's captions)
    val_shards: str | None = None  # image layout (json.captions), evaluated with eval.k_test / eval.rerank_score
    image_size: int | None = None  # fine-tuning resolution (ViT positions resized); default: init_from's
    augment: bool = True  # RandomResizedCrop + RandAugment (ALBEF / mPLUG retrieval fine-tuning)


@dataclass
class ClassificationTaskConfig:
    """`mplug finetune snli-ve|nlvr2` (tasks/classify/finetune.py) and `mplug eval snli-ve|nlvr2` (tasks/classify/evaluate.py):
    a classifier on the fused text [CLS] (models/heads/classifier.py); steps are optim.max_steps."""
    train_shards: str | None = None  # `make-shards snli-ve|nlvr2` shards
    val_shards: str | None = None  # accuracy after fine-tuning and by `mplug eval`
    image_size: int | None = None  # fine-tuning resolution (ViT positions resized); default: init_from's
    augment: bool = False  # RandomResizedCrop + RandAugment on training images
    freeze: list[str] = field(default_factory=list)  # image_encoder | text_encoder | fusion, kept frozen


@dataclass
class GroundingConfig:
    """`mplug finetune grounding` (tasks/grounding/finetune.py) and `mplug eval grounding` (tasks/grounding/evaluate.py): the
    decoder generates the box as 4 coordinate tokens (tasks/grounding/model.py); steps are optim.max_steps."""
    train_shards: str | None = None  # `make-shards grounding` shards
    val_shards: str | None = None  # Acc@0.5 after fine-tuning and by `mplug eval grounding`
    image_size: int | None = None  # fine-tuning resolution = coordinate bins (ViT positions resized)
    loss_weighting: Literal["l1_giou", "none"] = "l1_giou"  # official: token CE x L1 (clamped to 5) x (1 - GIoU)
    freeze: list[str] = field(default_factory=list)  # image_encoder | text_encoder | fusion, kept frozen


@dataclass
class EvalConfig:
    """`mplug eval retrieval|video-retrieval|video-qa|video-caption`. Input: ``shards`` (our shards), or
    ``annotations`` (the data set's own file) with its files under ``image_root`` / ``video_root``."""
    shards: str | None = None
    annotations: str | None = None  # Karpathy/COCO JSON, MSRVTT jsonl/csv, MSRVTT-QA/MSVD-QA, VATEX JSON
    split: str | None = "test"  # Karpathy split(s) of ``annotations`` (null for a COCO annotation file)
    image_root: str | None = None
    video_root: str | None = None
    video_name_format: str = "{}"  # video file name from an annotation's video id, e.g. "video{}" (MSRVTT-QA)
    video_mapping: str | None = None  # MSVD youtube_mapping.txt ("<clip name> vid<N>" per line)
    num_frames: int = 8
    frame_sampling: Literal["uniform", "middle"] = "uniform"
    video_backend: Literal["auto", "pyav", "decord"] = "auto"
    image_size: int | None = None  # input resolution; default: the checkpoint's (ViT positions resized)
    k_test: int = 128  # ITC candidates re-ranked by ITM per query (mPLUG: 256 COCO, 128 Flickr30K / MSRVTT)
    rerank_score: Literal["itc", "itm", "itm+itc"] = "itm"  # itc: no re-ranking
    batch_size: int = 16
    num_workers: int = 2  # reader processes (shards) and frame-decoding threads
    max_text_len: int = 35
    caption_metrics: Literal["coco", "cider"] = "coco"  # coco: BLEU, METEOR, ROUGE-L, CIDEr (+SPICE); cider: CIDEr only
    qa_inference: Literal["rank", "generate"] = "rank"
    answer_list: str | None = None  # JSON list, {answer: label} or one per line; default: the evaluated answers
    rank_k: int = 128  # answers kept by first-token probability before full scoring
    # video captioning (prompt, beam search) and video QA with qa_inference: generate (beam search)
    generation: GenerationSettings = field(default_factory=lambda: GenerationSettings(prompt="a video of",
                                                                                       min_length=1))
    output: str | None = None  # metrics JSON path; default <run dir>/metrics_<task>.json


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    run: RunConfig = field(default_factory=RunConfig)
    caption: CaptionConfig = field(default_factory=CaptionConfig)
    vqa: VQAConfig = field(default_factory=VQAConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    retrieval: RetrievalFinetuneConfig = field(default_factory=RetrievalFinetuneConfig)
    snli_ve: ClassificationTaskConfig = field(default_factory=ClassificationTaskConfig)
    nlvr2: ClassificationTaskConfig = field(default_factory=ClassificationTaskConfig)
    grounding: GroundingConfig = field(default_factory=GroundingConfig)
    init_from: str | None = None  # a pretrained model folder (save_pretrained / mplug export)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.run.output_dir, self.run.name)


def _validate_classification(task: ClassificationTaskConfig, section: str) -> None:
    unknown = [name for name in task.freeze if name not in VQA_FREEZABLE]
    if unknown:
        raise ConfigError(f"{section}.freeze: unknown part {unknown[0]!r} (known: {', '.join(VQA_FREEZABLE)})")
    if task.image_size is not None:
        check_positive(task.image_size, f"{section}.image_size")


def load_config(path: str | None = None, overrides: list[str] | None = None,
                check_paths: bool | Literal["eval"] = True) -> Config:
    """Resolve file + overrides into a validated Config (raises ConfigError)."""
    raw: dict = {}
    if path is not None:
        path = find_config(path)  # a path, or a config shipped in the package by name
        with open(path) as f:
            try:
                raw = yaml.safe_load(f) or {}
            except yaml.YAMLError as err:
                raise ConfigError(f"{path}: not valid YAML: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    raw = deep_merge(raw, parse_overrides(overrides or []))
    return config_from_dict(raw, check_paths=check_paths)


def config_from_dict(raw: dict, check_paths: bool | Literal["eval"] = True) -> Config:
    cfg = Config()
    preset = (raw.get("model") or {}).get("preset") if isinstance(raw.get("model"), dict) else None
    if preset is not None:
        from mplug_pretrain.models.presets import get_preset_config
        try:
            cfg.model = get_preset_config(preset)
        except KeyError as err:
            raise ConfigError(f"model.preset: unknown preset {preset!r}") from err
    raw = resolve_list_indices(raw, to_dict(cfg))  # `caption.stages.0.steps=5` over the default list
    cfg = build_dataclass(Config, raw, "", base=cfg)
    from mplug_pretrain.models.weights.bert import follow_bert_checkpoints
    follow_bert_checkpoints(cfg.model, raw.get("model") or {})  # sizes + compatibility, before any heavy work
    use_folder_tokenizer(cfg, cfg.init_from)
    validate(cfg, check_paths=check_paths)
    return cfg


def use_folder_tokenizer(cfg: Config, folder: str | None) -> None:
    """``data.tokenizer: null`` with a model folder that ships its own vocab.txt (every save_pretrained /
    export does): the folder's, so a model trained on another vocabulary (the demo's) is fed its own ids."""
    if cfg.data.tokenizer is None and folder and os.path.isfile(os.path.join(folder, "vocab.txt")):
        cfg.data.tokenizer = folder


def _refuse_nan(obj, prefix: str) -> None:
    """No float field anywhere may be NaN: it compares false with every bound, so range checks let it through."""
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if dataclasses.is_dataclass(item):
                _refuse_nan(item, name)
            elif isinstance(item, float) and math.isnan(item):
                raise ConfigError(f"{name}: expected a number, got nan")


def validate(cfg: Config, check_paths: bool | Literal["eval"] = True) -> None:
    """Every check; ``check_paths``: the files every path field names must exist (True), only those an
    evaluation reads (``"eval"``: eval.*, the val shards, answer list and tokenizer; not the training shards),
    or none (False)."""
    _refuse_nan(cfg, "")
    cfg.model.validate("model")
    d, o, dist, r = cfg.data, cfg.optim, cfg.distributed, cfg.run
    check_positive(d.batch_size, "data.batch_size")
    check_positive(d.num_workers, "data.num_workers", allow_zero=True)
    check_positive(d.max_text_len, "data.max_text_len")
    check_positive(d.shuffle_buffer, "data.shuffle_buffer")
    check_positive(d.max_image_pixels, "data.max_image_pixels")
    if d.samples_per_epoch is not None:
        if d.mode == "exact":
            raise ConfigError("data.samples_per_epoch: only used with data.mode=resampled (exact mode reads "
                              "every sample once per epoch); set it to null or set data.mode=resampled")
        check_positive(d.samples_per_epoch, "data.samples_per_epoch")
    if d.max_text_len > cfg.model.text.max_positions:
        raise ConfigError(f"model.text.max_positions: {cfg.model.text.max_positions} is shorter than "
                          f"data.max_text_len {d.max_text_len} (text tokens need a position each)")
    if d.train_weights is not None and d.train_shards and len(d.train_weights) != len(d.train_shards.split("::")):
        raise ConfigError(f"data.train_weights: {len(d.train_weights)} weights for "
                          f"{len(d.train_shards.split('::'))} sources in data.train_shards")
    for name in ("lr_vision", "lr_rest", "min_lr", "eps"):
        check_positive(getattr(o, name), f"optim.{name}", allow_zero=name == "min_lr")
    check_positive(o.weight_decay, "optim.weight_decay", allow_zero=True)
    check_positive(o.warmup_steps, "optim.warmup_steps", allow_zero=True)
    check_positive(o.max_steps, "optim.max_steps")
    check_positive(o.grad_accum_steps, "optim.grad_accum_steps")
    check_positive(o.grad_clip, "optim.grad_clip", allow_zero=True)
    if o.min_lr > min(o.lr_vision, o.lr_rest):
        raise ConfigError(f"optim.min_lr: {o.min_lr} is above a peak learning rate")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas: expected two values in [0, 1), got {list(o.betas)}")
    if dist.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"distributed.zero_stage: expected one of 0, 1, 2, 3, got {dist.zero_stage}")
    check_positive(dist.timeout_minutes, "distributed.timeout_minutes")
    if dist.offload_optimizer and dist.zero_stage == 0:
        raise ConfigError("distributed.offload_optimizer: needs zero_stage >= 1")
    if dist.template is not None and os.path.isfile(dist.template):
        read_deepspeed_template(dist.template, dist.zero_stage)
    if check_paths and d.tokenizer is not None and not os.path.isfile(os.path.join(d.tokenizer, "vocab.txt")):
        raise ConfigError(f"data.tokenizer: {d.tokenizer} is not a folder holding vocab.txt")
    check_positive(r.log_every, "run.log_every")
    check_positive(r.checkpoint_every_steps, "run.checkpoint_every_steps")
    check_positive(r.checkpoint_every_minutes, "run.checkpoint_every_minutes")
    check_positive(r.keep_last, "run.keep_last")
    check_positive(r.max_nonfinite_in_row, "run.max_nonfinite_in_row")
    check_positive(r.eval_every_steps, "run.eval_every_steps", allow_zero=True)
    check_positive(r.val_batches, "run.val_batches", allow_zero=True)
    if r.compile:
        _validate_compile(r.compile_backend, dist.zero_stage)
    if not r.name or "/" in r.name or r.name.startswith("."):
        raise ConfigError(f"run.name: expected a plain folder name, got {r.name!r}")
    _validate_field_names(cfg, r.allow_config_change, "run.allow_config_change")
    if not 0.0 <= cfg.caption.label_smoothing < 1.0:
        raise ConfigError(f"caption.label_smoothing: expected in [0, 1), got {cfg.caption.label_smoothing}")
    check_positive(cfg.caption.scst_samples, "caption.scst_samples")
    e = cfg.eval
    for name in ("num_frames", "k_test", "batch_size", "max_text_len", "rank_k"):
        check_positive(getattr(e, name), f"eval.{name}")
    e.generation.validate("eval.generation")
    check_positive(e.num_workers, "eval.num_workers", allow_zero=True)
    if e.image_size is not None:
        check_positive(e.image_size, "eval.image_size")
    try:
        formatted = e.video_name_format.format("x")
    except (IndexError, KeyError, ValueError):
        formatted = e.video_name_format
    if formatted == e.video_name_format:
        raise ConfigError(f"eval.video_name_format: needs a {{}} for the video id, got {e.video_name_format!r}")
    if e.shards is not None and e.annotations is not None:
        raise ConfigError("eval.shards / eval.annotations: both set; evaluate one input (set the other to null)")
    if check_paths:
        if e.shards is not None:
            check_path(e.shards, "eval.shards")
        for name in ("annotations", "image_root", "video_root", "video_mapping", "answer_list"):
            if getattr(e, name) is not None:
                check_exists(getattr(e, name), f"eval.{name}")
    check_positive(cfg.vqa.rank_k, "vqa.rank_k")
    cfg.vqa.generation.validate("vqa.generation")
    unknown = [name for name in cfg.vqa.freeze if name not in VQA_FREEZABLE]
    if unknown:
        raise ConfigError(f"vqa.freeze: unknown part {unknown[0]!r} (known: {', '.join(VQA_FREEZABLE)})")
    if cfg.vqa.image_size is not None:
        check_positive(cfg.vqa.image_size, "vqa.image_size")
    for section in ("snli_ve", "nlvr2", "grounding"):
        _validate_classification(getattr(cfg, section), section)
    if cfg.retrieval.image_size is not None:
        check_positive(cfg.retrieval.image_size, "retrieval.image_size")
    _validate_caption(cfg.caption)
    if check_paths:  # (field, value, shards?): shard specs may be folders or globs of .tar, the rest plain paths
        training = (("data.train_shards", d.train_shards, True), ("distributed.template", dist.template, False),
                    ("init_from", cfg.init_from, False), ("caption.train_shards", cfg.caption.train_shards, True),
                    ("caption.coco_json", cfg.caption.coco_json, False),
                    ("vqa.train_shards", cfg.vqa.train_shards, True))
        evaluation = (("data.val_shards", d.val_shards, True), ("caption.val_shards", cfg.caption.val_shards, True),
                      ("vqa.val_shards", cfg.vqa.val_shards, True), ("vqa.answer_list", cfg.vqa.answer_list, False))
        for name, value, shards in (evaluation if check_paths == "eval" else training + evaluation):
            if value is not None:
                (check_path if shards else check_exists)(value, name)


def _validate_compile(backend: str, zero_stage: int) -> None:
    """ConfigError unless ``backend`` is a torch.compile backend and the ZeRO stage keeps whole parameters
    (ZeRO-3 gathers them in hooks on every sub-module: each would break a block's graph)."""
    from torch._dynamo import list_backends
    known = sorted(set(list_backends(exclude_tags=())) | {"eager", "aot_eager"})
    if backend not in known:
        raise ConfigError(f"run.compile_backend: unknown torch.compile backend {backend!r} (known: {', '.join(known)})")
    if zero_stage == 3:
        raise ConfigError("run.compile: not with distributed.zero_stage=3 (its parameter gathers run inside every "
                          "block and break the compiled graphs); use zero_stage 0-2, or run.compile=false")


def _validate_field_names(cfg: Config, names: list[str], where: str) -> None:
    """Every entry names a config field or section (``optim``, ``optim.max_steps``, ``caption.stages``)."""
    tree = to_dict(cfg)
    for name in names:
        node = tree
        for part in name.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"{where}: {name!r} is not a config field (expected a dotted name such as "
                                  "optim.max_steps or a section such as optim)")
            node = node[part]


def _validate_caption(c: CaptionConfig) -> None:
    check_positive(c.scst_sigma, "caption.scst_sigma")
    c.generation.validate("caption.generation")
    if c.image_size is not None:
        check_positive(c.image_size, "caption.image_size")
    if not c.stages:
        raise ConfigError("caption.stages: expected at least one stage")
    names = [stage.name for stage in c.stages]
    for i, stage in enumerate(c.stages):
        where = f"caption.stages[{i}]"
        if not stage.name or "/" in stage.name or stage.name.startswith(".") or names.count(stage.name) > 1:
            raise ConfigError(f"{where}.name: expected a unique plain folder name, got {stage.name!r}")
        check_positive(stage.steps, f"{where}.steps")
        if stage.cached_features and not stage.freeze_vision:
            raise ConfigError(f"{where}.cached_features: needs freeze_vision: true "
                              "(cached features come from a frozen encoder)")
        if stage.objective == "scst" and c.scst_samples < 2:
            raise ConfigError(f"caption.scst_samples: SCST's baseline averages the other samples of an image, "
                              f"needs >= 2, got {c.scst_samples}")
        for name in ("lr_rest", "lr_vision", "batch_size", "grad_accum_steps"):
            if getattr(stage, name) is not None:
                check_positive(getattr(stage, name), f"{where}.{name}")
        for name in ("min_lr", "warmup_steps"):
            if getattr(stage, name) is not None:
                check_positive(getattr(stage, name), f"{where}.{name}", allow_zero=True)


def check_path(spec: str, name: str) -> None:
    """Every file a brace pattern / '::' list names must exist."""
    from mplug_pretrain.data.reading.urls import all_shards, expand_sources
    if not spec.strip():
        return
    try:
        urls = all_shards(expand_sources(spec))
    except ConfigError as err:  # a folder without shards, a glob matching nothing
        raise ConfigError(f"{name}: {str(err).removeprefix('urls: ')}") from None
    for url in urls:
        if "://" in url or url.startswith("pipe:"):
            continue
        if not os.path.exists(url) and not glob.glob(url):
            raise ConfigError(f"{name}: path does not exist: {url}{_demo_hint(url)}")


def _demo_hint(path: str) -> str:
    """The shipped configs read the demo shards, which `mplug demo` makes on first use: say so for a path there."""
    if os.path.normpath(path).split(os.sep)[0] != "data_shards":
        return ""
    return (f" (relative to {os.getcwd()}; the demo shards: `mplug demo --quick` makes data_shards/ here first, "
            "or point the field at your own shards)")


def check_exists(path: str, name: str) -> None:
    """A plain file or folder (an annotation file, an image root, a model folder) must exist."""
    if path.strip() and "://" not in path and not os.path.exists(path):
        raise ConfigError(f"{name}: path does not exist: {path}")


def config_text(cfg: Config) -> str:
    """The resolved config as the YAML text a run folder's config.yaml holds."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: str) -> None:
    with atomic_write(path) as f:
        f.write(config_text(cfg))


def resolve_precision(cfg: Config) -> str:
    if cfg.distributed.precision != "auto":
        return cfg.distributed.precision
    import torch
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


DERIVED_DEEPSPEED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                          "gradient_clipping", "optimizer", "scheduler")


def _object_without_duplicates(path: str, pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    duplicated = sorted({key for key in keys if keys.count(key) > 1})
    if duplicated:
        raise ConfigError(f"distributed.template: {path} sets {', '.join(duplicated)} more than once "
                          "(JSON keeps only the last; remove the others)")
    return dict(pairs)


def read_deepspeed_template(path: str, zero_stage: int) -> dict:
    """A DeepSpeed JSON template, checked: valid JSON object, no key twice, none of the keys derived from the
    run config, and a ZeRO stage (if it names one) equal to ``distributed.zero_stage``."""
    try:
        with open(path) as f:
            template = json.load(f, object_pairs_hook=lambda pairs: _object_without_duplicates(path, pairs))
    except json.JSONDecodeError as err:
        raise ConfigError(f"distributed.template: {path} is not valid JSON ({err})") from None
    if not isinstance(template, dict):
        raise ConfigError(f"distributed.template: {path} must hold a JSON object, got {type(template).__name__}")
    typed_twice = [k for k in DERIVED_DEEPSPEED_KEYS if k in template]
    if typed_twice:
        raise ConfigError(f"distributed.template: {path} sets {', '.join(typed_twice)}; these are derived "
                          "from the run config (data.batch_size, optim.*) and must not be typed twice")
    zero = template.get("zero_optimization", {})
    template_stage = zero.get("stage") if isinstance(zero, dict) else None
    if template_stage is not None and template_stage != zero_stage:
        raise ConfigError(f"distributed.template: {path} is for ZeRO stage {template_stage}, "
                          f"but distributed.zero_stage is {zero_stage}")
    return template


def engine_zero_stage(cfg: Config, world_size: int, partitioned_checkpoint: bool = False) -> int:
    """The ZeRO stage the engine runs: ``distributed.zero_stage``, except stages 1-2 on one rank, which run as
    stage 0 (``distributed.single_rank_zero0``; not with the optimizer offloaded, nor to resume a checkpoint
    written in the partitioned layout, ``partitioned_checkpoint``)."""
    dist = cfg.distributed
    if (world_size == 1 and dist.zero_stage in (1, 2) and dist.single_rank_zero0 and not dist.offload_optimizer
            and not partitioned_checkpoint):
        return 0
    return dist.zero_stage


def deepspeed_config(cfg: Config, world_size: int, partitioned_checkpoint: bool = False) -> dict:
    """Template (deepspeed_configs/) + the values derived from the run config.

    The template holds ZeRO tuning only; batch sizes, accumulation, clipping, precision and the
    stage come from ``cfg`` and must not be typed in the template too.
    """
    dist = cfg.distributed
    ds = read_deepspeed_template(dist.template or deepspeed_template(f"zero{dist.zero_stage}.json"), dist.zero_stage)
    ds["train_micro_batch_size_per_gpu"] = cfg.data.batch_size
    ds["gradient_accumulation_steps"] = cfg.optim.grad_accum_steps
    ds["train_batch_size"] = cfg.data.batch_size * cfg.optim.grad_accum_steps * world_size
    ds["gradient_clipping"] = cfg.optim.grad_clip
    # bf16 = DeepSpeed's torch_autocast mode, never its bf16 mode (which casts every parameter, the momentum
    # towers included, to bf16): fp32 parameters = masters, bf16 autocast inside the engine's forward
    # (docs/precision.md). Gradients are those of fp32 parameters, so micro-steps accumulate in fp32;
    # grad_accum_dtype says so explicitly where accumulation is used.
    precision = resolve_precision(cfg)
    ds["bf16"] = {"enabled": False}
    ds.pop("fp16", None)
    ds.pop("torch_autocast", None)
    if precision == "bf16":
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if cfg.optim.grad_accum_steps > 1:
        ds["data_types"] = {**ds.get("data_types", {}), "grad_accum_dtype": "fp32"}
    zero = dict(ds.get("zero_optimization", {}))
    zero["stage"] = engine_zero_stage(cfg, world_size, partitioned_checkpoint)
    if dist.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    else:
        zero.pop("offload_optimizer", None)
    ds["zero_optimization"] = zero
    ds["steps_per_print"] = 10 ** 9  # we log ourselves
    ds.setdefault("wall_clock_breakdown", False)
    if dist.offload_optimizer:
        ds["zero_force_ds_cpu_optimizer"] = False
    return ds
