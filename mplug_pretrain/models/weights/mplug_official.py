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
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

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


def load_official_checkpoint(model: nn.Module, source: str | dict[str, torch.Tensor],
                             strict: bool = False) -> ConversionResult:
    """Convert and load into ``model``. strict=True also fails when any of our keys was not provided."""
    official = read_official_checkpoint(source) if isinstance(source, str) else source
    result = convert_official_state_dict(official, model)
    own = model.state_dict()
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
    if result.missing:
        lines.append(f"missing (kept as initialized) {len(result.missing)}: {', '.join(result.missing[:limit])}")
    return "\n".join(lines)
