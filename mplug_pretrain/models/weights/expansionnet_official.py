"""Official ExpansionNet v2 checkpoints (jchenghu/ExpansionNet_v2: End_ExpansionNet_v2 / ExpansionNet_v2,
``{'model_state_dict': ..., ...}``) -> state dicts of our ExpansionDecoder and StaticExpansionRefiner.

Official name (models/layers.py, models/End_ExpansionNet_v2.py)   ours
decoders.n.norm_1 / norm_2 / norm_3                                decoder layers.n.norm_expansion / norm_cross / norm_ffn
decoders.n.dyn_exp.cond_embed / key_linear                         layers.n.expansion.condition / key
decoders.n.dyn_exp.{query,bias}_exp_vectors.weight                 layers.n.expansion.{query,bias}_vectors
decoders.n.mha.Wq / Wk / Wv / out_linear                           layers.n.cross.query / key / value / out
decoders.n.ff.linear_1 / linear_2                                  layers.n.ffn.0 / ffn.3
out_embedder.embed / pos_encoder                                   embedding.token / embedding.position
dec_reduce_group / dec_reduce_norm / vocab_linear                  combination.project / combination.norm / lm_head
encoders.n.norm_1 / norm_2                                         refiner layers.n.norm_expansion / norm_ffn
encoders.n.stc_exp.key_embed, {query,bias}_exp_vectors.weight      layers.n.expansion.key, {query,bias}_vectors
encoders.n.ff.linear_1 / linear_2                                  layers.n.ffn.0 / ffn.3
enc_reduce_group / enc_reduce_norm                                 combination.project / combination.norm
Sign convention: the official block computes selector * class_a + (1 - selector) * class_b with
class_a from ReLU(+M) and selector = sigmoid(S x); ours (the paper, Eq. 8) computes g * out(-M) +
(1 - g) * out(+M). So class_b_embed -> values.0 (the -M stream), class_a_embed -> values.1 (the +M stream),
and S is negated (1 - sigmoid(z) = sigmoid(-z)): gate.weight = -selector_embed.weight, gate.bias = -bias.
Not converted (listed in ``ignored``): swin_transf.* (our image encoder is the mPLUG ViT) and input_linear
(backbone features -> d_model). Numbers the weights cannot tell (heads, the block-static group sizes) are
arguments; the official defaults are 8 heads and G = (32, 64, 128, 256, 512).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from mplug_pretrain.errors import ConfigError, DataError

OFFICIAL_HEADS = 8
OFFICIAL_ENCODER_GROUP = (32, 64, 128, 256, 512)

_DECODER_LAYER = {
    "norm_1": "norm_expansion", "norm_2": "norm_cross", "norm_3": "norm_ffn",
    "dyn_exp.cond_embed": "expansion.condition", "dyn_exp.key_linear": "expansion.key",
    "dyn_exp.class_b_embed": "expansion.values.0", "dyn_exp.class_a_embed": "expansion.values.1",
    "dyn_exp.selector_embed": "expansion.gate",
    "mha.Wq": "cross.query", "mha.Wk": "cross.key", "mha.Wv": "cross.value", "mha.out_linear": "cross.out",
    "ff.linear_1": "ffn.0", "ff.linear_2": "ffn.3",
}
_ENCODER_LAYER = {
    "norm_1": "norm_expansion", "norm_2": "norm_ffn",
    "stc_exp.key_embed": "expansion.key",
    "stc_exp.class_b_embed": "expansion.values.0", "stc_exp.class_a_embed": "expansion.values.1",
    "stc_exp.selector_embed": "expansion.gate",
    "ff.linear_1": "ffn.0", "ff.linear_2": "ffn.3",
}
_VECTORS = {"query_exp_vectors.weight": "expansion.query_vectors", "bias_exp_vectors.weight": "expansion.bias_vectors"}
_DECODER_TOP = {
    "out_embedder.embed": "embedding.token", "pos_encoder": "embedding.position",
    "dec_reduce_group": "combination.project", "dec_reduce_norm": "combination.norm", "vocab_linear": "lm_head",
}
_ENCODER_TOP = {"enc_reduce_group": "combination.project", "enc_reduce_norm": "combination.norm"}
_IGNORED = [
    (r"^swin_transf\.", "Swin backbone: our image encoder is the mPLUG ViT"),
    (r"^input_linear\.", "backbone features -> d_model projection: the refiner reads mPLUG visual tokens"),
]
_NEGATED = re.compile(r"\.expansion\.gate\.(weight|bias)$")


@dataclass
class ExpansionNetConversion:
    decoder: dict[str, torch.Tensor]
    refiner: dict[str, torch.Tensor]
    decoder_config: dict  # DecoderConfig fields (+ vocab_size, width) that reproduce the official decoder
    refiner_config: dict  # VisualRefinerConfig fields (+ ffn_dim, width) of the official encoder
    ignored: dict[str, str] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)


def read_expansionnet_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of an official checkpoint (``{'model_state_dict': ...}`` or a bare state dict), loaded with
    torch.load(weights_only=True): a file that needs arbitrary unpickling is refused, never executed."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise DataError(f"{path}: not loadable with torch.load(weights_only=True) "
                         f"(only tensors and plain containers are accepted): {err}") from err
    if isinstance(ckpt, dict) and isinstance(ckpt.get("model_state_dict"), dict):
        ckpt = ckpt["model_state_dict"]
    if not isinstance(ckpt, dict):
        raise DataError(f"{path}: expected a dict with 'model_state_dict', got {type(ckpt).__name__}")
    tensors = {k.removeprefix("module."): v for k, v in ckpt.items() if isinstance(v, torch.Tensor)}
    if not any(k.startswith("decoders.") for k in tensors):
        raise DataError(f"{path}: no 'decoders.N.*' keys: not an ExpansionNet v2 model_state_dict")
    return tensors


def _rename(key: str) -> tuple[str, str] | None:
    """(part, our key) for an official key, part 'decoder' or 'refiner'; None if no rule applies."""
    m = re.match(r"^(decoders|encoders)\.(\d+)\.(.+)$", key)
    if m:
        part, table = ("decoder", _DECODER_LAYER) if m[1] == "decoders" else ("refiner", _ENCODER_LAYER)
        block = "dyn_exp." if part == "decoder" else "stc_exp."
        rest = m[3]
        if rest.startswith(block) and rest[len(block):] in _VECTORS:
            return part, f"layers.{m[2]}.{_VECTORS[rest[len(block):]]}"
        module, _, param = rest.rpartition(".")
        if module in table:
            return part, f"layers.{m[2]}.{table[module]}.{param}"
        return None
    module, _, param = key.rpartition(".")
    if module in _DECODER_TOP:
        return "decoder", f"{_DECODER_TOP[module]}.{param}"
    if module in _ENCODER_TOP:
        return "refiner", f"{_ENCODER_TOP[module]}.{param}"
    return None


def convert_expansionnet(official: dict[str, torch.Tensor], heads: int = OFFICIAL_HEADS,
                         encoder_group: tuple[int, ...] = OFFICIAL_ENCODER_GROUP) -> ExpansionNetConversion:
    """Rename (and sign-convert) an official state dict; derive the config fields from the tensor shapes."""
    parts: dict[str, dict[str, torch.Tensor]] = {"decoder": {}, "refiner": {}}
    ignored, unknown = {}, []
    for key, value in official.items():
        reason = next((why for pattern, why in _IGNORED if re.search(pattern, key)), None)
        if reason:
            ignored[key] = reason
            continue
        target = _rename(key)
        if target is None:
            unknown.append(key)
            continue
        part, ours = target
        parts[part][ours] = -value.clone() if _NEGATED.search(ours) else value.clone()
    dec, ref = parts["decoder"], parts["refiner"]
    if "embedding.token.weight" not in dec or "layers.0.expansion.query_vectors" not in dec:
        raise DataError("official checkpoint: decoder embedding or layer 0 missing (out_embedder / decoders.0)")
    vocab, width = dec["embedding.token.weight"].shape
    dec_layers = 1 + max(int(k.split(".")[1]) for k in dec if k.startswith("layers."))
    if heads < 1 or width % heads:
        raise ConfigError(f"--heads {heads}: the checkpoint's width {width} is not divisible by it")
    decoder_config = {"type": "expansion", "layers": dec_layers, "heads": heads,
                      "ffn_dim": dec["layers.0.ffn.0.weight"].shape[0],
                      "expansion_slots": dec["layers.0.expansion.query_vectors"].shape[0],
                      "max_positions": dec["embedding.position.weight"].shape[0],
                      "tie_word_embeddings": False, "vocab_size": vocab, "width": width}
    refiner_config = {}
    if ref:
        slots = ref["layers.0.expansion.query_vectors"].shape[0]
        if sum(encoder_group) != slots:
            raise ConfigError(f"--encoder-group {','.join(map(str, encoder_group))}: sums to {sum(encoder_group)}, the "
                              f"checkpoint's static expansion has {slots} query vectors")
        refiner_config = {"type": "static_expansion",
                          "layers": 1 + max(int(k.split(".")[1]) for k in ref if k.startswith("layers.")),
                          "expansion_slots": slots, "expansion_group": list(encoder_group),
                          "ffn_dim": ref["layers.0.ffn.0.weight"].shape[0], "width": width}
    return ExpansionNetConversion(dec, ref, decoder_config, refiner_config, ignored, sorted(unknown))


def load_converted(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """load_state_dict(strict) that names every missing / unexpected key."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{what}: converted weights do not fit: missing {missing}, unexpected {unexpected}")


def write_conversion(result: ExpansionNetConversion, out_dir: str | Path) -> Path:
    """out_dir/decoder.pt, refiner.pt (plain tensor dicts: torch.load(weights_only=True) reads them) and
    expansionnet_conversion.json (config fields, ignored and unknown keys)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result.decoder, out / "decoder.pt")
    if result.refiner:
        torch.save(result.refiner, out / "refiner.pt")
    summary = {k: v for k, v in asdict(result).items() if k not in ("decoder", "refiner")}
    (out / "expansionnet_conversion.json").write_text(json.dumps(summary, indent=2) + "\n")
    return out


def read_conversion(out_dir: str | Path) -> ExpansionNetConversion:
    """What ``write_conversion`` wrote (``mplug convert expansionnet --out DIR``), for ``expansionnet_check``'s
    ``build_decoder`` / ``build_refiner``: the modules around the converted weights."""
    out = Path(out_dir)
    summary_path = out / "expansionnet_conversion.json"
    if not summary_path.is_file():
        raise DataError(f"{out}: no expansionnet_conversion.json (not a `mplug convert expansionnet` output folder)")
    summary = json.loads(summary_path.read_text())
    refiner = torch.load(out / "refiner.pt", weights_only=True) if (out / "refiner.pt").is_file() else {}
    return ExpansionNetConversion(torch.load(out / "decoder.pt", weights_only=True), refiner,
                                  summary["decoder_config"], summary["refiner_config"], summary.get("ignored", {}),
                                  summary.get("unknown", []))
