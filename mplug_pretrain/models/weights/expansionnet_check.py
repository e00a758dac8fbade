"""Our modules around a converted ExpansionNet v2 checkpoint, and the check of the settings its weights cannot
tell. The tensors reveal the width, vocabulary, layer counts, FFN sizes, expansion slots and the encoder's total
static-expansion slots; they do not reveal the decoder's cross-attention heads (Wq/Wk/Wv are d x d whatever the
heads) nor how the encoder's slots are split into groups (only the sum of G is in the weights). Those two are
checked against the official model's outputs on a fixed input the user saves (``--compare FILE``):

    FILE = torch.save({"encoder_input":  [B, L, d] float (official: the tokens after input_linear),
                       "encoder_output": [B, L, d] float (official: forward_enc's output),
                       "decoder_ids":    [B, T] long     (any token ids),
                       "decoder_logits": [B, T, V] float (official: forward_dec on encoder_output, no padding)})

Either pair may be left out. A setting whose outputs differ is refused, naming the value that reproduces them when
one among the candidates does (heads: the divisors of d; groups: the orderings of the given sizes).
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch

from mplug_pretrain.errors import ConfigError, DataError
from mplug_pretrain.models.weights.expansionnet_official import ExpansionNetConversion, load_converted

TOLERANCE = 1e-4  # max abs difference of a matching conversion (float32 reorderings stay near 1e-6)
MAX_GROUP_ORDERINGS = 120


def build_decoder(result: ExpansionNetConversion, heads: int | None = None):
    """The ExpansionDecoder (eval mode, dropout 0) holding the converted weights: decoder(ids [B, T], mask [B, T],
    memory [B, L, d], memory_mask [B, L]).logits -> [B, T, V]."""
    from mplug_pretrain.models.decoders.expansionnet.decoder import ExpansionDecoder
    from mplug_pretrain.models.model_config import DecoderConfig
    fields = {k: v for k, v in result.decoder_config.items() if k not in ("vocab_size", "width")}
    if heads is not None:
        fields["heads"] = heads
    decoder = ExpansionDecoder(DecoderConfig(**fields, dropout=0.0), result.decoder_config["vocab_size"],
                               result.decoder_config["width"])
    load_converted(decoder, result.decoder, "decoder")
    return decoder.eval()


def build_refiner(result: ExpansionNetConversion, tokens: int, group: tuple[int, ...] | None = None):
    """The StaticExpansionRefiner (eval mode) holding the converted encoder: refiner(x [B, tokens, d]) -> same."""
    from mplug_pretrain.models.decoders.expansionnet.encoder import StaticExpansionRefiner
    from mplug_pretrain.models.model_config import VisualRefinerConfig
    cfg = result.refiner_config
    grid = math.isqrt(max(tokens - 1, 0))
    refiner = StaticExpansionRefiner(
        VisualRefinerConfig(type="static_expansion", layers=cfg["layers"], expansion_slots=cfg["expansion_slots"],
                            expansion_group=tuple(group or cfg["expansion_group"])),
        cfg["width"], grid, ffn_dim=cfg["ffn_dim"], dropout=0.0)
    refiner.tokens = tokens  # static expansion is position-free: any token count (official: 144, no CLS)
    load_converted(refiner, result.refiner, "refiner")
    return refiner.eval()


def read_reference(path: str | Path) -> dict[str, torch.Tensor]:
    try:
        ref = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise DataError(f"{path}: not loadable with torch.load(weights_only=True): {err}") from err
    pairs = (("encoder_input", "encoder_output"), ("decoder_ids", "decoder_logits"))
    if not isinstance(ref, dict) or not any(all(isinstance(ref.get(k), torch.Tensor) for k in p) for p in pairs):
        raise DataError(f"{path}: expected a dict of tensors with encoder_input + encoder_output and/or decoder_ids "
                        "+ decoder_logits (see `mplug convert expansionnet --help`)")
    return ref


@torch.no_grad()
def _decoder_diff(result, ref, heads: int) -> float:
    ids, memory = ref["decoder_ids"].long(), ref["encoder_output"].float() if "encoder_output" in ref else None
    if memory is None:
        raise DataError("--compare: decoder_logits need encoder_output too (the decoder's memory)")
    logits = build_decoder(result, heads)(ids, torch.ones(ids.shape), memory, torch.ones(memory.shape[:2])).logits
    return _max_diff(logits, ref["decoder_logits"], "decoder_logits")


@torch.no_grad()
def _refiner_diff(result, ref, group: tuple[int, ...]) -> float:
    x = ref["encoder_input"].float()
    return _max_diff(build_refiner(result, x.shape[1], group)(x), ref["encoder_output"], "encoder_output")


def _max_diff(ours: torch.Tensor, theirs: torch.Tensor, name: str) -> float:
    if ours.shape != theirs.shape:
        raise DataError(f"--compare: {name} is {tuple(theirs.shape)}, the converted model gives {tuple(ours.shape)}")
    return float((ours - theirs.float()).abs().max())


def check_against_reference(result: ExpansionNetConversion, ref: dict[str, torch.Tensor], path: str) -> list[str]:
    """Raises ConfigError naming the setting whose outputs differ from ``ref`` (and the one that matches, if
    found); -> the lines reporting what matched."""
    report = []
    heads = result.decoder_config["heads"]
    if "decoder_logits" in ref:
        diff = _decoder_diff(result, ref, heads)
        if diff > TOLERANCE:
            width = result.decoder_config["width"]
            fits = [h for h in range(1, width + 1) if width % h == 0 and h != heads
                    and _decoder_diff(result, ref, h) <= TOLERANCE]
            hint = f"--heads {fits[0]} reproduces them" if fits else "no head count reproduces them"
            raise ConfigError(f"--heads {heads}: the converted decoder's logits differ from {path}'s by up to "
                              f"{diff:.3g}; {hint}")
        report.append(f"decoder logits match {path} (max difference {diff:.2g}) with --heads {heads}")
    if result.refiner and "encoder_output" in ref and "encoder_input" in ref:
        group = tuple(result.refiner_config["expansion_group"])
        diff = _refiner_diff(result, ref, group)
        if diff > TOLERANCE:
            orderings = list(dict.fromkeys(itertools.permutations(group)))[:MAX_GROUP_ORDERINGS]
            fits = [g for g in orderings if g != group and _refiner_diff(result, ref, g) <= TOLERANCE]
            given = ",".join(map(str, group))
            hint = (f"--encoder-group {','.join(map(str, fits[0]))} reproduces them" if fits else
                    "no ordering of these sizes reproduces them (other sizes with the same sum may)")
            raise ConfigError(f"--encoder-group {given}: the converted encoder's outputs differ from {path}'s by "
                              f"up to {diff:.3g}; {hint}")
        report.append(f"encoder outputs match {path} (max difference {diff:.2g}) with --encoder-group "
                      f"{','.join(map(str, group))}")
    return report
