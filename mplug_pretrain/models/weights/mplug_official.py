"""Official mPLUG checkpoints (AliceMind / X-PLUG, ``mplug_base.pth`` ...) -> our MPLUG state dict.

Official name                                         ours
visual_encoder[_m].visual.X                           image_encoder[_m].vit.X
visn_fc[_m] / visn_layer_norm[_m] (ViT-L 1024->768)  image_encoder[_m].projection.linear / .norm
text_encoder[_m].embeddings / .encoder.layer.i        text_encoder[_m].embeddings / .layers.i
text_encoder.cls.predictions (MLM head, ALBEF style)  mlm_head
fusion_encoder.encoder.layer.(start + j)              fusion.layers.j   (start = official depth - fusion.layers:
                                                      the official FusionEncoder only runs its last layers)
text_decoder.bert.embeddings / .encoder.layer.i       decoder.embeddings / decoder.layers.i
text_decoder.cls.predictions.transform / .bias        decoder.head
vision_proj[_m], text_proj[_m], temp, queues          itc.*   (itc.queue_count = Q: official queues are full)
itm_head                                              itm_head.linear
Names inside those BERT parts are renamed by ``weights/bert.py`` (``rename_bert_key``, ``rename_lm_head_key``). Keys that exist officially but
are never used (CLIP text tower and projection, unused fusion layers and embeddings, momentum fusion /
decoder copies, tied LM weights, cross-attention of our connected layers) are listed in ``ignored`` with
the reason; keys no rule knows are listed in ``unknown``.

Checks before loading: the fusion stride (not recorded in the weights: read from the official
``config_bert*.json``'s ``stride_layer`` or stated by the caller) and width must match the model's, else a
ValueError says which setting to use. Momentum encoders absent from the checkpoint (caption / VQA checkpoints)
start as copies of the online ones, as the official model does when built, and ``describe`` says so.
"""
from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from mplug_pretrain.errors import DataError
from mplug_pretrain.models.fusion import fusion_schedule, schedule_pattern
from mplug_pretrain.models.weights.bert import rename_bert_key, rename_layer_key, rename_lm_head_key

# official prefix of a BertModel-shaped part (embeddings, encoder.layer.i) -> ours
BERT_PARTS = [("text_encoder.", "text_encoder."), ("text_encoder_m.", "text_encoder_m."),
              ("text_decoder.bert.", "decoder.")]
LM_HEADS = [("text_encoder.cls.predictions.", "mlm_head."), ("text_decoder.cls.predictions.", "decoder.head.")]

IGNORED_PATTERNS = [
    (r"^visual_encoder(_m)?\.visual\.proj$", "CLIP image projection: mPLUG uses the tokens before it"),
    ((r"^visual_encoder(_m)?\.(positional_embedding|text_projection|logit_scale|token_embedding\..*|ln_final\..*"
      r"|transformer\..*)$"), "CLIP text tower, unused by mPLUG"),
    (r"\.embeddings\.position_ids$", "position-id buffer (recomputed)"),
    (r"^fusion_encoder_m\.", "momentum fusion copy: ITC uses only the momentum image and text encoders"),
    (r"^text_decoder_m\.", "momentum decoder copy (VQA distillation), not used"),
    (r"^fusion_encoder\.embeddings\.", "fusion embeddings: the fusion network consumes text-encoder states"),
    (r"^(text_encoder|text_decoder)\.cls\.predictions\.decoder\.(weight|bias)$", "tied to word embeddings / bias"),
]


@dataclass
class ConversionResult:
    state_dict: dict[str, torch.Tensor]
    ignored: dict[str, str] = field(default_factory=dict)  # official key -> why it is not used
    unknown: list[str] = field(default_factory=list)  # official keys no rule maps
    missing: list[str] = field(default_factory=list)  # our keys the checkpoint did not provide
    # momentum keys the checkpoint lacked, copied from their online counterparts (as the official model does
    # when it is built: copy_params) instead of being left at their random start
    momentum_from_online: list[str] = field(default_factory=list)


def read_official_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Tensors of an official ``.pth`` (``{'model': state_dict, ...}``), read with weights_only=True."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{path}: not loadable with torch.load(weights_only=True): {err}") from err
    for wrapper in ("model", "module", "state_dict"):
        if isinstance(ckpt, dict) and isinstance(ckpt.get(wrapper), dict):
            ckpt = ckpt[wrapper]
    return {k.removeprefix("module."): v for k, v in ckpt.items() if isinstance(v, torch.Tensor)}


def _rename(key: str, start: int, connected: list[bool]) -> str | tuple[None, str] | None:
    """Our name for an official key, (None, reason) when deliberately unused, None when unknown."""
    m = re.match(r"^visual_encoder(_m)?\.visual\.(.+)$", key)
    if m:
        return f"image_encoder{m[1] or ''}.vit.{m[2]}"
    m = re.match(r"^(visn_fc|visn_layer_norm)(_m)?\.(weight|bias)$", key)
    if m:
        part = "linear" if m[1] == "visn_fc" else "norm"
        return f"image_encoder{m[2] or ''}.projection.{part}.{m[3]}"
    for theirs, ours in BERT_PARTS:
        if key.startswith(theirs) and (renamed := rename_bert_key(key.removeprefix(theirs))):
            return ours + renamed
    for theirs, ours in LM_HEADS:
        if key.startswith(theirs) and (renamed := rename_lm_head_key(key.removeprefix(theirs))):
            return ours + renamed
    m = re.match(r"^fusion_encoder\.encoder\.layer\.(\d+)\.(.+)$", key)
    if m and rename_layer_key(m[2]):
        j = int(m[1]) - start
        if j < 0:
            return None, "fusion layer below the ones the official FusionEncoder runs"
        if j >= len(connected):
            return None, "fusion layer beyond model.fusion.layers"
        ours = rename_layer_key(m[2])
        if connected[j] and ours.startswith(("cross_attn", "cross_norm")):
            return None, "cross-attention of a connected-attention layer is never run"
        return f"fusion.layers.{j}.{ours}"
    m = re.match(r"^(vision_proj|text_proj)(_m)?\.(weight|bias)$", key)
    if m:
        return f"itc.{m[1]}{m[2] or ''}.{m[3]}"
    if re.match(r"^itm_head\.(weight|bias)$", key):
        return "itm_head.linear." + key.split(".")[1]
    if key in ("temp", "image_queue", "text_queue", "idx_queue", "queue_ptr"):
        return f"itc.{key}"
    return None


def convert_official_state_dict(official: dict[str, torch.Tensor], model: nn.Module) -> ConversionResult:
    """Rename an official state dict for ``model`` (an MPLUG: its fusion schedule and queue size matter)."""
    fusion_indices = [int(m[1]) for k in official if (m := re.match(r"^fusion_encoder\.encoder\.layer\.(\d+)\.", k))]
    n_fusion = len(model.fusion.layers)
    start = max(0, max(fusion_indices, default=-1) + 1 - n_fusion)
    connected = list(getattr(model.fusion, "schedule", [False] * n_fusion))
    result = ConversionResult({})
    for key, value in official.items():
        reason = next((why for pattern, why in IGNORED_PATTERNS if re.search(pattern, key)), None)
        if reason:
            result.ignored[key] = reason
            continue
        ours = _rename(key, start, connected)
        if ours is None:
            result.unknown.append(key)
        elif isinstance(ours, tuple):
            result.ignored[key] = ours[1]
        else:
            result.state_dict[ours] = value
    _convert_itc_state(result, model)
    own = model.state_dict()
    result.missing = sorted(set(own) - set(result.state_dict))
    stray = sorted(set(result.state_dict) - set(own))
    for key in stray:  # e.g. ViT-L projection keys for a model without projection
        result.state_dict.pop(key)
        result.unknown.append(key)
    return result


def _convert_itc_state(result: ConversionResult, model: nn.Module) -> None:
    """Reshape temp / idx_queue / queue_ptr to our layouts; drop queues of another size; set queue_count."""
    sd, itc = result.state_dict, model.itc
    if "itc.temp" in sd:
        sd["itc.temp"] = sd["itc.temp"].reshape(itc.temp.shape)
    if "itc.idx_queue" in sd:
        sd["itc.idx_queue"] = sd["itc.idx_queue"].reshape(-1).long()
    if "itc.queue_ptr" in sd:
        sd["itc.queue_ptr"] = sd["itc.queue_ptr"].reshape(()).long()
    queue_keys = ("itc.image_queue", "itc.text_queue", "itc.idx_queue", "itc.queue_ptr")
    if "itc.image_queue" not in sd:
        return
    if sd["itc.image_queue"].shape != itc.image_queue.shape:
        for key in queue_keys:
            if key in sd:
                result.ignored[key.removeprefix("itc.")] = (f"queue size {tuple(sd.pop(key).shape)} differs from "
                                                            f"model.heads.queue_size {itc.queue_size}; queues start empty")
        return
    sd["itc.queue_count"] = torch.tensor(itc.queue_size, dtype=torch.long)


def read_official_config(path: str) -> dict:
    """The official BERT config JSON (``config_bert_stride3.json`` ...): plain JSON, never code."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: not a readable official BERT config JSON ({err})") from err
    if not isinstance(config, dict):
        raise DataError(f"{path}: expected a JSON object (the official config_bert*.json)")
    return config


def check_official_layout(model: nn.Module, official_config: dict | None, stride: int | None) -> None:
    """Refuse a checkpoint whose fusion stride or width differs from ``model``'s. The weights do not record the
    stride (every official fusion layer keeps its cross-attention), so it comes from the official config's
    ``stride_layer`` or from ``stride``; with neither, warn that it was not checked."""
    config = official_config or {}
    width = config.get("hidden_size")
    own_width = model.fusion.layers[0].ffn_norm.normalized_shape[0]
    if width is not None and width != own_width:
        raise ValueError(f"official checkpoint width {width} (hidden_size) differs from the model's {own_width}: "
                         "use the preset of the official model (base: 768)")
    official_stride = config.get("stride_layer", stride)
    if stride is not None and official_stride != stride:
        raise ValueError(f"stride {stride} given, but the official config says stride_layer {official_stride}")
    if official_stride is None:
        warnings.warn("official checkpoint: fusion stride not checked (the weights do not record it); pass the "
                      "official config_bert*.json or its stride_layer (base 3, large 6)", stacklevel=3)
        return
    theirs = fusion_schedule(len(model.fusion.layers), int(official_stride), "code")
    if theirs != list(model.fusion.schedule):
        raise ValueError(f"official checkpoint has fusion stride {official_stride} "
                         f"({schedule_pattern(theirs)}), the model's fusion is {schedule_pattern(model.fusion.schedule)}: "
                         f"set model.fusion.stride={official_stride} (schedule_rule code)")


def fill_momentum_from_online(result: ConversionResult, own: dict[str, torch.Tensor]) -> None:
    """Copy online weights into momentum keys (``*_m.*``) the checkpoint did not provide."""
    for key in list(result.missing):
        online = key.replace("_m.", ".", 1)
        if "_m." in key and online in result.state_dict and result.state_dict[online].shape == own[key].shape:
            result.state_dict[key] = result.state_dict[online].clone()
            result.momentum_from_online.append(key)
            result.missing.remove(key)


def load_official_checkpoint(model: nn.Module, source: str | dict[str, torch.Tensor], strict: bool = False,
                             official_config: str | dict | None = None, stride: int | None = None) -> ConversionResult:
    """Convert and load into ``model``. strict=True also fails when any of our keys was not provided.
    official_config: the official BERT config (path or dict) or ``stride``: checked against the model's fusion."""
    if isinstance(official_config, str):
        official_config = read_official_config(official_config)
    check_official_layout(model, official_config, stride)
    official = read_official_checkpoint(source) if isinstance(source, str) else source
    result = convert_official_state_dict(official, model)
    own = model.state_dict()
    fill_momentum_from_online(result, own)
    bad = [k for k, v in result.state_dict.items() if v.shape != own[k].shape]
    if bad:
        raise ValueError("official checkpoint shapes differ from the model config: "
                         + ", ".join(f"{k} {tuple(result.state_dict[k].shape)} vs {tuple(own[k].shape)}" for k in bad[:5]))
    model.load_state_dict(result.state_dict, strict=strict)
    return result


def describe(result: ConversionResult, limit: int | None = 20) -> str:
    """Human-readable summary of a conversion (what was ignored and why, unknown and missing keys)."""
    reasons: dict[str, int] = {}
    for why in result.ignored.values():
        reasons[why] = reasons.get(why, 0) + 1
    lines = [f"converted {len(result.state_dict)} tensors"]
    lines += [f"ignored {n}: {why}" for why, n in sorted(reasons.items())]
    if result.unknown:
        lines.append(f"unknown {len(result.unknown)}: {', '.join(result.unknown[:limit])}")
    if result.momentum_from_online:
        lines.append(f"momentum copied from the online weights (not in the checkpoint) "
                     f"{len(result.momentum_from_online)}: {', '.join(result.momentum_from_online[:limit])}")
    if result.missing:
        lines.append(f"missing (kept as initialized) {len(result.missing)}: {', '.join(result.missing[:limit])}")
    return "\n".join(lines)
