"""mPLUG: CLIP ViT + BERT text encoder + cross-modal skip-connected fusion + text decoder (mPLUG §3, Fig. 2).

    image [B, 3, H, W] --ImageEncoder--> V [B, 1+M, D]          (ViT tokens, projected to D, optionally refined)
    ids, mask [B, T]   --TextEncoder --> L [B, T, D]             (first K BERT layers)
    fuse(V, L) -> (V', L')                                       (SkipConnectedFusion or an ablation design)
    memory = [V'; L'] with the concatenated mask --decoder--> next-token logits

Pretraining ``forward(batch)`` computes, sharing one image encoding:
    ITC on (V[:,0], L[:,0] or the masked token mean: itc_pooling) + momentum, queues, distillation (heads/itc.py)
    ITM on the fused text [CLS] of 3B pairs with hard negatives                (heads/itm.py)
    MLM on the fused masked text                                               (heads/mlm.py)
    PrefixLM: decoder continues the caption from fuse(V, prefix)               (heads/prefix_lm.py)
    loss = sum_k w_k L_k with w = heads.loss_weights.
Momentum encoders (``image_encoder_m``, ``text_encoder_m``, ``itc.*_proj_m``) take no gradient; the training
engine updates them after every optimizer step (models/step_hooks.py). They and the ITC queues are part of the
state dict (checkpoints must hold them). In training mode ``forward`` pushes this step's momentum features
into the queues after computing the losses; with ``defer_enqueue`` (set by the training engine) it keeps them
pending instead, and the loop calls ``commit_enqueue()`` once the loss is known finite on every rank (or
``discard_enqueue()``), so a skipped batch leaves the queues as they were. In eval mode the queues are left
untouched.
Host syncs: none in ``forward`` for a batch without padding rows (docs/precision.md; bench/NOTES.md).
Shared work: the ITM, MLM and PrefixLM fusion passes of one ``forward`` reuse the image states' cross-attention
keys and values of the fusion layers that see them unchanged (``fusion.image_keys_values``), ITM fuses its 3B
rows by index (no copy of the image states per row), and the BERT decoder's PrefixLM self-attention is causal by
``is_causal`` (its targets are right padded). ``fast_fusion_paths = False`` computes each pass on its own with
the dense causal bias, as before: the reference the tests compare these paths with.
"""
from __future__ import annotations

import copy
import os

import torch
from torch import nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.bert import BertDecoder
from mplug_pretrain.models.decoders.factory import build_decoder
from mplug_pretrain.models.folder.config_io import CONFIG_FILE, read_model_config, write_model_config
from mplug_pretrain.models.folder.hub import resolve_model_folder
from mplug_pretrain.models.folder.model_card import write_model_card
from mplug_pretrain.models.fusion import build_fusion
from mplug_pretrain.models.heads.classifier import FusedClassifier
from mplug_pretrain.models.heads.itc import ImageTextContrastive
from mplug_pretrain.models.heads.itm import ImageTextMatchingHead, sample_hard_negatives
from mplug_pretrain.models.heads.itm_pool import gather_pool, pool_examples, pool_negatives
from mplug_pretrain.models.heads.lm_head import LMPredictionHead
from mplug_pretrain.models.heads.mlm import mask_tokens, mlm_loss
from mplug_pretrain.models.heads.prefix_lm import prefix_lm_loss, split_prefix
from mplug_pretrain.models.inference import InferenceMixin
from mplug_pretrain.models.layers.bert_init import bert_init_
from mplug_pretrain.models.model_config import ModelConfig
from mplug_pretrain.models.step_hooks import StepHooks
from mplug_pretrain.models.towers.text import TextEncoder, pool_text
from mplug_pretrain.models.towers.vision import ImageEncoder, resize_positional_embedding
from mplug_pretrain.models.weights.reader import load_weights_into, save_weights
from mplug_pretrain.utils import process_group
from mplug_pretrain.utils.host_syncs import host_any

LOSS_NAMES = ("itc", "itm", "mlm", "prefixlm")
WEIGHTS_FILE = "model.safetensors"


class MPLUG(InferenceMixin, StepHooks, nn.Module):
    fast_fusion_paths = True  # module docstring, "Shared work"

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        unknown = sorted(set(config.heads.loss_weights) - set(LOSS_NAMES))
        if unknown:
            raise ConfigError(f"model.heads.loss_weights.{unknown[0]}: unknown loss (known: {', '.join(LOSS_NAMES)})")
        self.config = copy.deepcopy(config)
        t, h = config.text, config.heads
        self.image_encoder = ImageEncoder(config.vision, t.width, t.dropout, config.refiner)
        self.text_encoder = TextEncoder(t.vocab_size, t.width, t.heads, t.ffn_dim, t.encoder_layers, t.max_positions,
                                        t.dropout)
        self.fusion = build_fusion(config.fusion, t.width, t.heads, t.ffn_dim, t.dropout)
        self.decoder = build_decoder(config.decoder, vocab_size=t.vocab_size, width=t.width)
        self.itc = ImageTextContrastive(t.width, h.embed_dim, h.temperature, h.queue_size, momentum=h.use_momentum)
        self.itm_head = ImageTextMatchingHead(t.width)
        self.mlm_head = LMPredictionHead(t.width, t.vocab_size, tied=True)
        self.classifier: FusedClassifier | None = None
        if h.classifier_classes:
            self.classifier = FusedClassifier(t.width, h.classifier_classes, h.classifier_images)
        self._init_bert_style()
        self._load_pretrained_parts()
        self.image_encoder_m: ImageEncoder | None = None
        self.text_encoder_m: TextEncoder | None = None
        if h.use_momentum:
            self.image_encoder_m = copy.deepcopy(self.image_encoder)
            self.text_encoder_m = copy.deepcopy(self.text_encoder)
            self.itc.vision_proj_m.load_state_dict(self.itc.vision_proj.state_dict())
            self.itc.text_proj_m.load_state_dict(self.itc.text_proj.state_dict())
            for _, momentum in self.momentum_pairs():
                momentum.requires_grad_(False)
        self.set_grad_checkpointing(config.grad_checkpointing)
        self.defer_enqueue = False
        self._pending_enqueue: tuple | None = None

    # ----------------------------------------------------------------- construction helpers
    def _init_bert_style(self) -> None:
        """BERT init (N(0, 0.02) weights, zero biases, unit LayerNorms) for everything BERT-initialized in mPLUG
        (the BERT decoder initialises itself so)."""
        parts = [self.text_encoder, self.fusion, self.itc.vision_proj, self.itc.text_proj, self.itm_head, self.mlm_head,
                 self.classifier]
        if self.image_encoder.projection is not None:
            parts.append(self.image_encoder.projection)
        for part in filter(None, parts):
            bert_init_(part)
        if self.config.text.init == "scratch":
            self._init_from_scratch()

    def _init_from_scratch(self) -> None:
        """``text.init: scratch`` (model_config.TextConfig): fan-in scaled text-side weights, N(0, 0.1^2) word embeddings."""
        for part in (self.text_encoder, self.fusion, self.itc):
            for module in part.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=module.in_features ** -0.5)
        nn.init.normal_(self.text_encoder.embeddings.word_embeddings.weight, std=0.1)

    def _load_pretrained_parts(self) -> None:
        from mplug_pretrain.models.towers.external import load_tower_weights
        from mplug_pretrain.models.weights.bert import (
            init_decoder_from_bert,
            init_text_from_bert,
            warn_if_text_features_collapse,
        )
        from mplug_pretrain.models.weights.clip_vision import load_vision_checkpoint
        v = self.config.vision
        if v.checkpoint_path and v.backbone != "clip_vit":
            load_tower_weights(self.image_encoder.vit, v.checkpoint_path)
        elif v.checkpoint_path:
            load_vision_checkpoint(self.image_encoder.vit, v.checkpoint_path, v.checkpoint_format)
        self.init_report: dict = {}
        if self.config.text.bert_checkpoint:
            self.init_report["text"] = init_text_from_bert(self, self.config.text.bert_checkpoint)
            warn_if_text_features_collapse(self.text_encoder, self.config.itc_pooling,
                                           self.config.text.bert_checkpoint)
        if self.config.decoder.bert_checkpoint:
            if not isinstance(self.decoder, BertDecoder):
                raise ConfigError(f"model.decoder.bert_checkpoint: only the bert decoder loads BERT weights, "
                                  f"decoder.type is {self.config.decoder.type!r}")
            self.init_report["decoder"] = init_decoder_from_bert(self, self.config.decoder.bert_checkpoint)

    # ------------------------------------------------- step hooks (models/step_hooks.py: what the engine does)
    @property
    def momentum(self) -> float:
        return self.config.heads.momentum

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        if self.image_encoder_m is None:
            return []
        return [(self.image_encoder, self.image_encoder_m), (self.text_encoder, self.text_encoder_m),
                (self.itc.vision_proj, self.itc.vision_proj_m), (self.itc.text_proj, self.itc.text_proj_m)]

    def clamped_parameters(self) -> list[tuple[nn.Parameter, float, float]]:
        from mplug_pretrain.models.heads.itc import TEMPERATURE_RANGE
        return [(self.itc.temp, *TEMPERATURE_RANGE)]

    # ----------------------------------------------------------------- encoders
    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """image [B, 3, H, W] -> visual states [B, 1+M, D] (ViT tokens, projected and refined)."""
        return self.image_encoder(image)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """ids, mask [B, T] -> unimodal text states [B, T, D]."""
        return self.text_encoder(input_ids, attention_mask)

    def fuse(self, image_states: torch.Tensor, image_mask: torch.Tensor | None, text_states: torch.Tensor,
             text_mask: torch.Tensor, image_rows: torch.Tensor | None = None,
             image_kv: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (fused image [B, M, D], fused text [B, T, D]); image_mask None = every visual token is real.
        image_rows [B']: text row i fuses with image row image_rows[i]; image_kv: ``fusion.image_keys_values``
        of ``image_states`` (models/fusion.py)."""
        return self.fusion(image_states, image_mask, text_states, text_mask, image_rows, image_kv)

    def memory_from_states(self, image_states: torch.Tensor, image_mask: torch.Tensor | None,
                           prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                           image_kv: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder memory concat(fused image, fused prompt) [B, M+T, D] and its mask [B, M+T] (long)."""
        image, text = self.fuse(image_states, image_mask, self.encode_text(prompt_ids, prompt_mask), prompt_mask,
                                image_kv=image_kv)
        if image_mask is None:
            image_mask = torch.ones(image.shape[:2], dtype=torch.long, device=image.device)
        return torch.cat([image, text], dim=1), torch.cat([image_mask.long(), prompt_mask.long()], dim=1)

    def memory(self, image: torch.Tensor, prompt_ids: torch.Tensor,
               prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder memory for captioning / VQA: image + prompt (e.g. "[CLS] a picture of [SEP]" or a question)."""
        return self.memory_from_states(self.encode_image(image), None, prompt_ids, prompt_mask)

    # ----------------------------------------------------------------- classification (SNLI-VE, NLVR2)
    def add_classifier(self, classes: int, images: int = 1) -> None:
        """Attach a freshly initialised (BERT-style) ``FusedClassifier``; recorded in the config, so a saved folder
        rebuilds it."""
        self.config.heads.classifier_classes, self.config.heads.classifier_images = classes, images
        self.classifier = FusedClassifier(self.config.text.width, classes, images)
        for linear in (self.classifier.hidden, self.classifier.out):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)

    def classify(self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """images [B, I, 3, H, W], statement ids / mask [B, T] -> logits [B, C]. The statement is encoded once and
        fused with each image separately (heads/classifier.py)."""
        if self.classifier is None:
            raise RuntimeError("classify: this model has no classifier head (heads.classifier_classes is 0)")
        b, i = images.shape[:2]
        text = self.encode_text(input_ids, attention_mask).repeat_interleave(i, 0)
        _, fused = self.fuse(self.encode_image(images.flatten(0, 1)), None, text,
                             attention_mask.repeat_interleave(i, 0))
        return self.classifier(fused[:, 0].view(b, i, -1))

    # ----------------------------------------------------------------- pretraining
    def forward(self, batch: dict, alpha: float | None = None) -> dict[str, torch.Tensor]:
        """batch: image [B,3,H,W], input_ids / attention_mask [B,T] ([CLS] .. [SEP], right padded),
        optional image_id [B] (same id = positive pair), optional is_pad [B]. alpha: distillation weight (default
        heads.distill_alpha). -> {'loss', 'loss_itc', 'loss_itm', 'loss_mlm', 'loss_prefixlm'}.
        Blank rows (is_pad with image_id -1: ``ImageTextFormat.blank()``, a slot with no real sample yet) are
        dropped; a batch of blank rows only runs with weight 0 and adds nothing to the queues, so every rank still
        runs one forward/backward (and the queue all-gather) while the gradient is zero."""
        for key in ("image", "input_ids", "attention_mask"):
            if key not in batch:
                raise KeyError(f"pretraining batch lacks {key!r} (has {sorted(batch)})")
        image, ids, mask = batch["image"], batch["input_ids"], batch["attention_mask"]
        idx = batch.get("image_id")
        weight = 1.0
        # is_pad is read first where it is (the training loop keeps it on the host): no sync without padding
        if idx is not None and "is_pad" in batch and host_any(batch["is_pad"]):
            blank = batch["is_pad"].to(idx.device) & (idx < 0)
            if bool(blank.all()):
                idx, weight = None, 0.0  # no ids to pair: diagonal positives, then weight 0
            elif bool(blank.any()):
                image, ids, mask, idx = image[~blank], ids[~blank], mask[~blank], idx[~blank]
        h = self.config.heads
        alpha = h.distill_alpha if alpha is None else alpha
        weights = {name: float(h.loss_weights.get(name, 1.0)) for name in LOSS_NAMES}

        image_states = self.encode_image(image)
        text_states = self.encode_text(ids, mask)
        image_feat = self.itc.image_features(image_states[:, 0])
        text_feat = self.itc.text_features(pool_text(text_states, mask, self.config.itc_pooling))
        image_feat_m, text_feat_m = self._momentum_features(image, ids, mask, image_feat, text_feat)
        image_kv = None
        if self.fast_fusion_paths and (weights["itm"] or weights["mlm"] or weights["prefixlm"]):
            image_kv = self.fusion.image_keys_values(image_states)
        losses = {}
        if weights["itc"]:
            self.itc.clamp_temperature()
            losses["itc"] = self.itc.loss(image_feat, text_feat, image_feat_m, text_feat_m, idx,
                                          alpha if self.image_encoder_m is not None else 0.0, h.itc_negatives)
        if weights["itm"]:
            losses["itm"] = self._itm_loss(image_states, text_states, mask, image_feat, text_feat, idx, image_kv)
        if weights["mlm"]:
            masked_ids, labels = mask_tokens(ids, mask, self.config.text.vocab_size, h.mlm_probability)
            _, fused = self.fuse(image_states, None, self.encode_text(masked_ids, mask), mask, image_kv=image_kv)
            losses["mlm"] = mlm_loss(self.mlm_head, fused, labels, self.text_encoder.embeddings.word_embeddings.weight)
        if weights["prefixlm"]:
            split = split_prefix(ids, mask, h.prefix_min_tokens)
            losses["prefixlm"] = self._decoder_loss(image_states, split, image_kv=image_kv)
        if self.training:  # every rank enqueues (a collective); a blank batch adds no row
            rows = slice(None) if weight else slice(0, 0)
            pending = (image_feat_m[rows], text_feat_m[rows], None if idx is None else idx[rows])
            if self.defer_enqueue:
                self._pending_enqueue = pending
            else:
                self.itc.enqueue(*pending)
        zero = image_states.new_zeros(())
        out = {f"loss_{name}": losses.get(name, zero) * weight for name in LOSS_NAMES}
        out["loss"] = sum(weights[name] * losses[name] for name in losses) * weight
        return out

    def commit_enqueue(self) -> None:
        """Write the momentum features the last deferred forward kept pending (every rank together)."""
        if self._pending_enqueue is not None:
            pending, self._pending_enqueue = self._pending_enqueue, None
            self.itc.enqueue(*pending)

    def discard_enqueue(self) -> None:
        """Drop the pending features (the step was skipped: its loss was not finite on some rank)."""
        self._pending_enqueue = None

    @torch.no_grad()
    def _momentum_features(self, image: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                           image_feat: torch.Tensor, text_feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.image_encoder_m is None:
            return image_feat.detach(), text_feat.detach()
        image_m = self.itc.image_features(self.image_encoder_m(image)[:, 0], momentum=True)
        text_m = self.itc.text_features(pool_text(self.text_encoder_m(ids, mask), mask, self.config.itc_pooling),
                                        momentum=True)
        return image_m, text_m

    def _itm_loss(self, image_states: torch.Tensor, text_states: torch.Tensor, mask: torch.Tensor,
                  image_feat: torch.Tensor, text_feat: torch.Tensor, idx: torch.Tensor | None,
                  image_kv: list | None = None) -> torch.Tensor:
        if self.config.heads.itm_negatives == "global" and process_group.world_size() > 1:
            pool = gather_pool(image_states, text_states, mask, image_feat, text_feat, idx)
            examples = pool_examples(image_states, text_states, mask, pool,
                                     pool_negatives(pool, image_feat, text_feat, self.itc.similarities))
            _, fused = self.fuse(examples.images, None, examples.texts, examples.text_mask, examples.image_rows)
            return self.itm_head.loss(fused[:, 0], examples.labels, examples.weights)
        b = image_states.shape[0]
        with torch.no_grad():
            negatives = sample_hard_negatives(self.itc.similarities(image_feat, text_feat.t()), idx)
        # all 3B examples keep their rows (no boolean selection: a host sync); a row without a true negative
        # gets weight 0
        rows = torch.arange(b, device=image_states.device)
        image_rows = torch.cat([rows, negatives.image_for_text, rows])
        text_rows = torch.cat([rows, rows, negatives.text_for_image])
        weights = torch.cat([torch.ones_like(negatives.text_valid), negatives.text_valid, negatives.image_valid])
        labels = torch.zeros(3 * b, dtype=torch.long, device=image_states.device)
        labels[:b] = 1
        if self.fast_fusion_paths:
            _, fused = self.fuse(image_states, None, text_states[text_rows], mask[text_rows], image_rows, image_kv)
        else:
            _, fused = self.fuse(image_states[image_rows], None, text_states[text_rows], mask[text_rows])
        return self.itm_head.loss(fused[:, 0], labels, weights)

    def _decoder_loss(self, image_states: torch.Tensor, split, label_smoothing: float = 0.0,
                      image_kv: list | None = None) -> torch.Tensor:
        memory, memory_mask = self.memory_from_states(image_states, None, split.prefix_ids, split.prefix_mask,
                                                      image_kv)
        causal = {"right_padded": True} if self.fast_fusion_paths and isinstance(self.decoder, BertDecoder) else {}
        logits = self.decoder(split.target_ids, split.target_mask, memory, memory_mask, **causal).logits
        return prefix_lm_loss(logits, split.target_ids, split.target_mask, label_smoothing)

    def caption_loss(self, image: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     prompt_length: int, label_smoothing: float = 0.0) -> torch.Tensor:
        """Caption fine-tuning (mPLUG caption recipe): input_ids = [CLS] prompt caption [SEP] (right padded),
        ``prompt_length`` = leading tokens forming the prompt, [CLS] included ("a picture of" -> 4).
        The prompt "[CLS] a picture of [SEP]" goes through text encoder + fusion with the image; the decoder
        predicts the whole caption after the prompt ("[CLS]" as BOS ... "[SEP]"). Token-mean cross-entropy."""
        return self.caption_loss_from_states(self.encode_image(image), input_ids, attention_mask, prompt_length,
                                             label_smoothing)

    def caption_loss_from_states(self, image_states: torch.Tensor, input_ids: torch.Tensor,
                                 attention_mask: torch.Tensor, prompt_length: int,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
        """``caption_loss`` from visual states [B, 1+M, D] already computed (a frozen ViT, cached features)."""
        if prompt_length < 1:
            raise ValueError(f"prompt_length counts [CLS] and must be >= 1, got {prompt_length}")
        split = split_prefix(input_ids, attention_mask, split=torch.tensor(prompt_length - 1))
        return self._decoder_loss(image_states, split, label_smoothing)

    @torch.no_grad()
    def momentum_update(self) -> None:
        """theta_m <- m * theta_m + (1 - m) * theta for every momentum pair (call after each optimizer step)."""
        from mplug_pretrain.models.layers.momentum import ema_update_
        m = self.momentum
        for online, momentum in self.momentum_pairs():
            params = list(online.parameters())
            if any(hasattr(p, "ds_id") and p.ds_numel != p.numel() for p in params):
                raise RuntimeError("momentum_update: parameters are partitioned (DeepSpeed ZeRO stage 3); "
                                   "momentum encoders need replicated parameters: use ZeRO stage 1 or 2")
            ema_update_(list(momentum.parameters()), params, m)  # one multi-tensor update per module pair

    # ----------------------------------------------------------------- training utilities
    def set_grad_checkpointing(self, enable: bool | str = True) -> None:
        """Activation checkpointing (torch.utils.checkpoint, use_reentrant=False) of ViT blocks, BERT text and
        fusion layers and decoder layers: False, True (whole layer) or "selective" (layers/checkpointing.py;
        a timm / open_clip tower checkpoints whole blocks in its own way for either)."""
        from mplug_pretrain.models.layers.checkpointing import MODES
        if enable not in MODES or not isinstance(enable, (bool, str)):
            raise ConfigError(f"model.grad_checkpointing: expected false, true or 'selective', got {enable!r}")
        self.config.grad_checkpointing = enable
        for module in (self.image_encoder.vit, self.text_encoder, self.fusion, self.decoder,
                       self.image_encoder.refiner):
            if module is None:
                continue
            if hasattr(module, "set_grad_checkpointing"):
                module.set_grad_checkpointing(enable)
            elif hasattr(module, "grad_checkpointing"):
                module.grad_checkpointing = enable

    def param_groups(self, weight_decay: float, lr_vision: float, lr_rest: float) -> list[dict]:
        """AdamW groups: vision_decay / vision_no_decay (ViT, ``lr_vision``) and rest_decay / rest_no_decay
        (everything else, ``lr_rest``). No decay on biases, norms (all 0/1-d tensors), embeddings and the
        temperature. Momentum copies (no grad) are excluded; empty groups are left out."""
        no_decay_ids = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        vit = self.image_encoder.vit
        no_decay_ids |= {id(vit.get_parameter(name)) for name in vit.no_weight_decay()}
        groups: dict[str, dict] = {}
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            tower = "vision" if name.startswith("image_encoder.vit.") else "rest"
            decay = p.ndim >= 2 and id(p) not in no_decay_ids
            key = f"{tower}_{'decay' if decay else 'no_decay'}"
            group = groups.setdefault(key, {"name": key, "params": [], "lr": lr_vision if tower == "vision" else lr_rest,
                                            "weight_decay": weight_decay if decay else 0.0})
            group["params"].append(p)
        order = ("vision_decay", "vision_no_decay", "rest_decay", "rest_no_decay")
        return [groups[k] for k in order if k in groups]

    # ----------------------------------------------------------------- save / load
    def save_pretrained(self, directory: str) -> None:
        """Write ``config.json`` and ``model.safetensors`` (all weights incl. momentum copies and ITC queues;
        a tied decoder's output projection is stored once, under its token embedding's name)."""
        os.makedirs(directory, exist_ok=True)
        write_model_config(self.config, os.path.join(directory, CONFIG_FILE))
        save_weights(self, os.path.join(directory, WEIGHTS_FILE))
        write_model_card(directory)  # README.md: what the model is; rewritten as the folder grows

    @classmethod
    def from_pretrained(cls, directory: str, image_size: int | None = None) -> MPLUG:
        """Load a ``save_pretrained`` folder (strict), or a Hub id ``org/name`` (models/folder/hub.py). ``image_size`` re-targets the ViT to a new input size,
        resizing its positional embeddings bilinearly (fine-tuning at a higher resolution)."""
        from safetensors.torch import load_file
        directory = resolve_model_folder(directory)  # a local folder, or a Hub id from huggingface_hub's cache
        config = read_model_config(os.path.join(directory, CONFIG_FILE))
        state = load_file(os.path.join(directory, WEIGHTS_FILE))
        if image_size is not None and image_size != config.vision.image_size:
            if config.vision.backbone != "clip_vit":
                raise ConfigError(f"image_size {image_size}: re-targeting the input size is for our ViT only, not "
                                  f"{config.vision.backbone} ({config.vision.image_size} px)")
            config.vision.image_size = image_size
            grid = image_size // config.vision.patch_size
            for key in ("image_encoder.vit.positional_embedding", "image_encoder_m.vit.positional_embedding"):
                if key in state:
                    state[key] = resize_positional_embedding(state[key], grid)
        model = cls(config)
        load_weights_into(model, state, os.path.join(directory, WEIGHTS_FILE))
        return model
