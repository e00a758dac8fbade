"""Typed model configuration. Plain dataclasses: the run config (``mplug_pretrain.config``) embeds
``ModelConfig`` and validates types/Literals generically; cross-field rules live in ``validate``.

Presets (tiny / base / large) are built in ``presets.py`` from these classes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.utils.value_checks import check_positive


@dataclass
class VisionConfig:
    """CLIP ViT image encoder. Tokens: 1 + (image_size // patch_size) ** 2."""
    image_size: int = 256
    patch_size: int = 16
    width: int = 768
    layers: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    checkpoint_path: str | None = None  # OpenAI CLIP / open_clip / timm file, loaded at build time
    checkpoint_format: Literal["auto", "openai", "open_clip", "timm"] = "auto"
    project_to_text_width: bool = True  # Linear + LayerNorm when width != text width (ViT-L 1024 -> 768)
    # clip_vit (ours) | timm:<name> | open_clip:<name> (models/towers/external.py); for the latter two the
    # sizes above other than image_size are the tower's own, and backbone_kwargs go to the factory
    backbone: str = "clip_vit"
    backbone_kwargs: dict = field(default_factory=dict)
    backbone_pretrained: bool = False  # timm's pretrained weights (its Hub cache)


@dataclass
class TextConfig:
    """BERT text encoder (first ``encoder_layers`` layers) and fusion (next ``fusion_layers``)."""
    vocab_size: int = 30522
    width: int = 768
    heads: int = 12
    ffn_dim: int = 3072
    encoder_layers: int = 6
    max_positions: int = 512
    dropout: float = 0.1
    bert_checkpoint: str | None = None  # BertModel folder; layers split between encoder and fusion
    # "bert": N(0, 0.02) weights and embeddings (BERT's; right under a bert_checkpoint). "scratch": fan-in
    # N(0, 1/d_in) for the text encoder, fusion and ITC projections and N(0, 0.1^2) word embeddings (they
    # then outweigh the position embeddings), for training without a checkpoint: under BERT's init every
    # caption's [CLS] is the same vector (cosine 1.00 on the demo data), so ITC starts at a symmetric
    # saddle and stays at chance for 1000+ steps.
    init: Literal["bert", "scratch"] = "bert"


@dataclass
class FusionConfig:
    """Cross-modal fusion. ``skip`` = mPLUG skip-connected network with ``stride`` S.

    schedule_rule "code": layer j (0-based) is connected iff j != 0 and j % S == 0 (released weights).
    schedule_rule "paper": layer i (1-based) is connected iff i % (S + 1) == 0 (Algorithm 1).
    """
    type: Literal["skip", "all_connected", "two_stream"] = "skip"
    layers: int = 6
    stride: int = 3
    schedule_rule: Literal["code", "paper"] = "code"


@dataclass
class DecoderConfig:
    """Text decoder head over memory = concat(image_states, text_states).

    bert: BERT LM decoder with cross-attention (mPLUG). expansion: ExpansionNet v2 decoder
    (dynamic expansion + cross-attention + FFN). acf: decoder with causal adaptive-clustering
    self-attention.
    """
    type: Literal["bert", "expansion", "acf"] = "bert"
    layers: int = 12
    heads: int = 12
    ffn_dim: int = 3072
    dropout: float = 0.1
    max_positions: int = 512
    expansion_slots: int = 16  # N_E for dynamic expansion
    bert_checkpoint: str | None = None  # full BertModel folder for the bert decoder
    tie_word_embeddings: bool = True
    acf_formula: Literal["paper", "official"] = "paper"  # acf: paper equations or the official code (models/acf.py)


@dataclass
class VisualRefinerConfig:
    """Optional refiner over visual tokens before fusion: static expansion (ExpansionNet v2
    encoder layers) or 2-D adaptive clustering attention (ACF)."""
    type: Literal["none", "static_expansion", "acf"] = "none"
    layers: int = 2
    expansion_slots: int = 64  # N_E for static expansion
    expansion_group: tuple = ()  # block static expansion coefficient set G; empty = plain static
    acf_formula: Literal["paper", "official"] = "paper"  # acf: paper equations or the official code (models/acf.py)


@dataclass
class HeadsConfig:
    """Pretraining heads: ITC (+ momentum distillation), ITM, MLM, PrefixLM."""
    embed_dim: int = 256
    temperature: float = 0.07
    queue_size: int = 65536
    momentum: float = 0.995
    distill_alpha: float = 0.4
    use_momentum: bool = True
    mlm_probability: float = 0.15
    prefix_min_tokens: int = 1  # PrefixLM split point rule parameters (see heads/prefix_lm)
    loss_weights: dict = field(default_factory=lambda: {"itc": 1.0, "itm": 1.0, "mlm": 1.0, "prefixlm": 1.0})
    # ITC in-batch negatives: the rank's own micro-batch (the paper's) or every rank's (features gathered)
    itc_negatives: Literal["rank", "global"] = "rank"
    # ITM hard negatives: drawn from the rank's own micro-batch (the paper's) or from every rank's (states gathered
    # with their gradient: heads/itm_pool.py)
    itm_negatives: Literal["rank", "global"] = "rank"
    # fine-tuned classification head (heads/classifier.py; SNLI-VE: 3 classes, 1 image; NLVR2: 2 classes,
    # 2 images); 0 = none. Set by `mplug finetune snli-ve|nlvr2`, kept in the model folder's config.json.
    classifier_classes: int = 0
    classifier_images: int = 1


# sizes that must be > 0: a zero would fail later as a ZeroDivisionError or an empty tensor
POSITIVE_FIELDS = {
    "vision": ("image_size", "patch_size", "width", "layers", "heads", "mlp_ratio"),
    "text": ("vocab_size", "width", "heads", "ffn_dim", "max_positions"),
    "fusion": ("layers", "stride"),
    "decoder": ("layers", "heads", "ffn_dim", "max_positions"),
    "heads": ("embed_dim", "temperature", "queue_size"),
}

# upper bounds, checked before anything is allocated: a config.json asking for width 10^9 once tried to allocate
# 512 GB. Each is several times the largest released model of its kind (ViT-22B: width 6144, ffn 24576, 48
# layers; XLM-R: vocab 250k).
MAX_SIZES = {
    "vision": {"image_size": 4096, "patch_size": 512, "width": 16384, "layers": 256, "heads": 256, "mlp_ratio": 16},
    "text": {"vocab_size": 2_000_000, "width": 16384, "heads": 256, "ffn_dim": 65536, "encoder_layers": 256,
             "max_positions": 65536},
    "fusion": {"layers": 256, "stride": 256},
    "decoder": {"layers": 256, "heads": 256, "ffn_dim": 65536, "max_positions": 65536, "expansion_slots": 4096},
    "refiner": {"layers": 256, "expansion_slots": 4096},
    "heads": {"embed_dim": 16384, "queue_size": 4_194_304, "classifier_classes": 1_000_000, "classifier_images": 16},
}


@dataclass
class ModelConfig:
    preset: str = "base"
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    refiner: VisualRefinerConfig = field(default_factory=VisualRefinerConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    # activation checkpointing of every block: false, true (whole layer) or "selective" (layers/checkpointing.py)
    grad_checkpointing: bool | Literal["selective"] = False
    # the text vector ITC projects: the [CLS] state (mPLUG) or the masked mean of the caption's tokens
    # (text.pool_text; for BERT checkpoints whose early-layer [CLS] is the same for every caption)
    itc_pooling: Literal["cls", "mean"] = "cls"

    def validate(self, prefix: str = "model") -> None:
        """Range and cross-field checks; raises ConfigError naming the dotted field."""
        v, t = self.vision, self.text
        for section, names in POSITIVE_FIELDS.items():
            for name in names:
                check_positive(getattr(getattr(self, section), name), f"{prefix}.{section}.{name}")
        check_positive(t.encoder_layers, f"{prefix}.text.encoder_layers", allow_zero=True)
        for section, limits in MAX_SIZES.items():
            for name, limit in limits.items():
                value = getattr(getattr(self, section), name)
                if value > limit:
                    raise ConfigError(f"{prefix}.{section}.{name}: {value} is above the largest accepted, {limit} "
                                      "(a damaged or hostile config; nothing was allocated)")
        from mplug_pretrain.models.towers.external import parse_backbone
        if parse_backbone(v.backbone)[0] == "clip_vit" and v.image_size % v.patch_size:
            raise ConfigError(f"{prefix}.vision.image_size: {v.image_size} is not a multiple of "
                              f"patch_size {v.patch_size}")
        if v.width % v.heads:
            raise ConfigError(f"{prefix}.vision.width: {v.width} not divisible by heads {v.heads}")
        if t.width % t.heads:
            raise ConfigError(f"{prefix}.text.width: {t.width} not divisible by heads {t.heads}")
        if t.width % self.decoder.heads:
            raise ConfigError(f"{prefix}.decoder.heads: text width {t.width} not divisible by {self.decoder.heads}")
        from mplug_pretrain.models.layers.checkpointing import MODES
        if self.grad_checkpointing not in MODES or not isinstance(self.grad_checkpointing, (bool, str)):
            raise ConfigError(f"{prefix}.grad_checkpointing: expected false, true (whole layer) or 'selective', "
                              f"got {self.grad_checkpointing!r}")
        check_positive(self.heads.classifier_classes, f"{prefix}.heads.classifier_classes", allow_zero=True)
        check_positive(self.heads.classifier_images, f"{prefix}.heads.classifier_images")
        if not 0.0 <= self.heads.momentum < 1.0:
            raise ConfigError(f"{prefix}.heads.momentum: expected in [0, 1), got {self.heads.momentum}")
        if not 0.0 < self.heads.mlm_probability < 1.0:
            raise ConfigError(f"{prefix}.heads.mlm_probability: expected in (0, 1), got {self.heads.mlm_probability}")
        for path in (v.checkpoint_path, t.bert_checkpoint, self.decoder.bert_checkpoint):
            if path is not None:
                import os
                if not os.path.exists(path):
                    name = {v.checkpoint_path: "vision.checkpoint_path", t.bert_checkpoint: "text.bert_checkpoint"}.get(
                        path, "decoder.bert_checkpoint")
                    raise ConfigError(f"{prefix}.{name}: path does not exist: {path}")
