"""Initialize mPLUG's text side from a BERT checkpoint folder (transformers ``BertModel`` layout).

With K = text.encoder_layers, F = fusion.layers and L checkpoint layers (mPLUG §3.1: BERT-base layers
1-6 -> text encoder, 7-12 -> fusion; the decoder from the full BERT, as the released code does):
    text encoder   <- embeddings, layers 0 .. K-1
    fusion layer j <- layer K + j (self-attention + FFN; both streams of two-stream fusion), if K + j < L
    decoder        <- embeddings, layers 0 .. min(L, decoder.layers) - 1
    MLM / decoder LM head transform + bias <- ``cls.predictions`` when the file has them
Cross-attention weights have no BERT counterpart and keep their fresh initialization. Everything that
was not copied is listed in the returned report. For a 6-layer BERT (MiniLM) use e.g. K = 3, F = 3.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from mplug_pretrain.errors import ConfigError

# transformers BertLayer parameter names -> ours (text.BertLayer)
BERT_LAYER_KEYS = {
    "attention.self.query": "attn.query", "attention.self.key": "attn.key", "attention.self.value": "attn.value",
    "attention.output.dense": "attn.out", "attention.output.LayerNorm": "attn_norm",
    "crossattention.self.query": "cross_attn.query", "crossattention.self.key": "cross_attn.key",
    "crossattention.self.value": "cross_attn.value", "crossattention.output.dense": "cross_attn.out",
    "crossattention.output.LayerNorm": "cross_norm",
    "intermediate.dense": "ffn_in", "output.dense": "ffn_out", "output.LayerNorm": "ffn_norm",
}
BERT_EMBEDDING_KEYS = {
    "word_embeddings": "word_embeddings", "position_embeddings": "position_embeddings",
    "token_type_embeddings": "token_type_embeddings", "LayerNorm": "norm",
}
BERT_LM_HEAD_KEYS = {"transform.dense": "transform", "transform.LayerNorm": "norm", "bias": "bias"}


def rename_layer_key(suffix: str) -> str | None:
    """'attention.self.query.weight' -> 'attn.query.weight'; None when the name is not a BertLayer one."""
    for theirs, ours in BERT_LAYER_KEYS.items():
        if suffix.startswith(theirs + "."):
            return ours + suffix[len(theirs):]
    return None


def rename_embedding_key(suffix: str) -> str | None:
    for theirs, ours in BERT_EMBEDDING_KEYS.items():
        if suffix.startswith(theirs + "."):
            return ours + suffix[len(theirs):]
    return None


def rename_lm_head_key(suffix: str) -> str | None:
    """Suffix after ``cls.predictions.``; the tied ``decoder.*`` weights map to nothing."""
    for theirs, ours in BERT_LM_HEAD_KEYS.items():
        if suffix == theirs or suffix.startswith(theirs + "."):
            return ours + suffix[len(theirs):]
    return None


def rename_bert_key(key: str) -> str | None:
    """A BertModel key (no ``bert.`` prefix) -> ours below a text encoder or decoder:
    'embeddings.LayerNorm.weight' -> 'embeddings.norm.weight', 'encoder.layer.3.output.dense.bias' ->
    'layers.3.ffn_out.bias'; None for anything else."""
    if key.startswith("embeddings."):
        ours = rename_embedding_key(key.removeprefix("embeddings."))
        return None if ours is None else f"embeddings.{ours}"
    parts = key.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"] and parts[2].isdigit():
        ours = rename_layer_key(parts[3])
        return None if ours is None else f"layers.{parts[2]}.{ours}"
    return None


def read_bert_checkpoint(path: str, field: str = "model.text.bert_checkpoint") -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict without the ``bert.`` prefix, config.json) of a BERT folder (safetensors or torch .bin);
    ``field`` names the setting in errors."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path}: no config.json (expected a transformers BERT folder)")
    with open(config_file) as f:
        config = json.load(f)
    weights = os.path.join(path, "model.safetensors")
    if os.path.isfile(weights):
        from safetensors.torch import load_file
        sd = load_file(weights)
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        from mplug_pretrain.models.weights.weights_file import read_weights_file, tensors_only
        bin_file = os.path.join(path, "pytorch_model.bin")
        sd = tensors_only(read_weights_file(bin_file, field), bin_file)
    else:
        raise FileNotFoundError(f"{path}: neither model.safetensors nor pytorch_model.bin")
    return {k.removeprefix("bert."): v for k, v in sd.items()}, config


def _check_config(config: dict, width: int, heads: int, ffn_dim: int, vocab_size: int, field: str, path: str) -> None:
    expected = {"hidden_size": width, "num_attention_heads": heads, "intermediate_size": ffn_dim,
                "vocab_size": vocab_size}
    for key, ours in expected.items():
        if key in config and config[key] != ours:
            raise ConfigError(f"{field}: {path} has {key}={config[key]} but the model has {ours}")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ConfigError(f"{field}: {path} uses hidden_act={config['hidden_act']!r}; only 'gelu' is supported")


def _copy(target: nn.Module, name: str, value: torch.Tensor, copied: list[str], prefix: str) -> None:
    param = target.get_parameter(name)
    if name.endswith("position_embeddings.weight") and value.shape[0] > param.shape[0]:
        value = value[: param.shape[0]]  # fewer positions configured than the checkpoint has
    if param.shape != value.shape:
        raise ConfigError(f"{prefix}{name}: checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)
    copied.append(prefix + name)


def _copy_embeddings(sd: dict, embeddings: nn.Module, copied: list[str], prefix: str) -> None:
    for key, value in sd.items():
        if key.startswith("embeddings."):
            ours = rename_embedding_key(key[len("embeddings."):])
            if ours is not None:
                _copy(embeddings, ours, value, copied, prefix)


def _copy_layer(sd: dict, index: int, layer: nn.Module, copied: list[str], prefix: str) -> None:
    head = f"encoder.layer.{index}."
    for key, value in sd.items():
        if key.startswith(head):
            ours = rename_layer_key(key[len(head):])
            if ours is not None and (not ours.startswith(("cross_attn", "cross_norm")) or layer.cross_attn is not None):
                _copy(layer, ours, value, copied, prefix)


def _copy_lm_head(sd: dict, head: nn.Module, copied: list[str], prefix: str) -> None:
    for key, value in sd.items():
        if key.startswith("cls.predictions."):
            ours = rename_lm_head_key(key[len("cls.predictions."):])
            if ours is not None:
                _copy(head, ours, value, copied, prefix)


def checkpoint_layers(sd: dict) -> int:
    return 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("encoder.layer."))


def init_text_from_bert(model: nn.Module, path: str) -> dict:
    """Text encoder, fusion and MLM head of an MPLUG from BERT at ``path``; returns {copied, not_copied}."""
    sd, config = read_bert_checkpoint(path)
    t = model.config.text
    _check_config(config, t.width, t.heads, t.ffn_dim, t.vocab_size, "model.text.bert_checkpoint", path)
    depth, k = checkpoint_layers(sd), t.encoder_layers
    if k > depth:
        raise ConfigError(f"model.text.encoder_layers: {k} > {depth} layers in {path}")
    copied: list[str] = []
    _copy_embeddings(sd, model.text_encoder.embeddings, copied, "text_encoder.embeddings.")
    for i in range(k):
        _copy_layer(sd, i, model.text_encoder.layers[i], copied, f"text_encoder.layers.{i}.")
    streams = [("fusion.layers", model.fusion.layers)]
    if hasattr(model.fusion, "image_layers"):
        streams.append(("fusion.image_layers", model.fusion.image_layers))
    for name, layers in streams:
        for j, layer in enumerate(layers):
            if k + j < depth:
                _copy_layer(sd, k + j, layer, copied, f"{name}.{j}.")
    _copy_lm_head(sd, model.mlm_head, copied, "mlm_head.")
    return _report(model, ("text_encoder.", "fusion.", "mlm_head."), copied)


def init_decoder_from_bert(model: nn.Module, path: str) -> dict:
    """The BERT decoder of an MPLUG from BERT at ``path`` (cross-attention stays new)."""
    sd, config = read_bert_checkpoint(path, "model.decoder.bert_checkpoint")
    d, width = model.config.decoder, model.config.text.width
    _check_config(config, width, d.heads, d.ffn_dim, model.config.text.vocab_size, "model.decoder.bert_checkpoint",
                  path)
    copied: list[str] = []
    decoder = model.decoder
    _copy_embeddings(sd, decoder.embeddings, copied, "decoder.embeddings.")
    for i in range(min(checkpoint_layers(sd), len(decoder.layers))):
        _copy_layer(sd, i, decoder.layers[i], copied, f"decoder.layers.{i}.")
    _copy_lm_head(sd, decoder.head, copied, "decoder.head.")
    return _report(model, ("decoder.",), copied)


def _report(model: nn.Module, prefixes: tuple[str, ...], copied: list[str]) -> dict:
    done = set(copied)
    fresh = [n for n, _ in model.named_parameters() if n.startswith(prefixes) and n not in done]
    return {"copied": copied, "not_copied": fresh}


# cosine above which the ITC text vectors of different captions count as one vector
COLLAPSE_COSINE = 0.99


def probe_text_spread(text_encoder: nn.Module, pooling: str, vocab_size: int, captions: int = 8,
                      length: int = 10, seed: int = 0) -> float:
    """Mean pairwise cosine of the pooled text states of ``captions`` distinct random word sequences
    ([CLS] w_1 .. w_n [SEP], ids from BERT's word-piece range 1000+): near 1 when the pooled vector
    ignores the words. Eval mode, no gradient; the encoder's mode is restored."""
    from mplug_pretrain.models.decoders.api import BOS_ID, EOS_ID
    from mplug_pretrain.models.towers.text import pool_text
    g = torch.Generator().manual_seed(seed)
    device = next(text_encoder.parameters()).device
    ids = torch.randint(min(1000, vocab_size - 1), vocab_size, (captions, length), generator=g)
    ids[:, 0], ids[:, -1] = BOS_ID, EOS_ID
    mask = torch.ones_like(ids)
    was_training = text_encoder.training
    text_encoder.eval()
    with torch.no_grad():
        pooled = pool_text(text_encoder(ids.to(device), mask.to(device)), mask.to(device), pooling).float()
    text_encoder.train(was_training)
    unit = torch.nn.functional.normalize(pooled, dim=-1)
    sims = unit @ unit.t()
    return float((sims.sum() - sims.diagonal().sum()) / (captions * (captions - 1)))


def warn_if_text_features_collapse(text_encoder: nn.Module, pooling: str, path: str) -> float:
    """Log a warning when different captions get (nearly) the same ITC text vector; returns the cosine."""
    import logging
    cosine = probe_text_spread(text_encoder, pooling, text_encoder.embeddings.word_embeddings.num_embeddings)
    if cosine > COLLAPSE_COSINE:
        logging.getLogger(__name__).warning(
            "model.text.bert_checkpoint: %s: the text encoder's %s vectors of different captions have mean "
            "cosine %.4f; ITC cannot tell captions apart from them. Set model.itc_pooling=mean (masked mean of "
            "the tokens)", path,
            "[CLS]" if pooling == "cls" else "mean-pooled", cosine)
    return cosine


# our field -> the BERT config.json key it must equal
BERT_SIZE_KEYS = {"width": "hidden_size", "heads": "num_attention_heads", "ffn_dim": "intermediate_size",
                  "vocab_size": "vocab_size"}


def read_bert_config(path: str) -> dict:
    """``config.json`` of a BERT folder (no weights read): cheap enough for config validation."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"{path}: no config.json (expected a transformers BERT folder)")
    with open(config_file) as f:
        return json.load(f)


def follow_bert_checkpoints(model_cfg, explicit: dict, prefix: str = "model") -> None:
    """Sizes from the BERT checkpoints' config.json, checked at config time (before any model or DeepSpeed).

    With ``text.bert_checkpoint``: text.width / heads / ffn_dim / vocab_size become the checkpoint's (fusion
    and decoder share the text width); with ``decoder.bert_checkpoint`` also decoder.heads / ffn_dim. A size
    the user set explicitly (``explicit``: the raw ``model`` mapping of the YAML + overrides) that differs
    raises ConfigError, as do too many text layers and an activation other than gelu."""
    t, d = model_cfg.text, model_cfg.decoder
    explicit_text = (explicit.get("text") or {}) if isinstance(explicit, dict) else {}
    explicit_decoder = (explicit.get("decoder") or {}) if isinstance(explicit, dict) else {}
    sources = [("text", t, t.bert_checkpoint, explicit_text, ("width", "heads", "ffn_dim", "vocab_size")),
               ("decoder", d, d.bert_checkpoint, explicit_decoder, ("heads", "ffn_dim"))]
    for section, target, path, given, names in sources:
        if not path or not os.path.isdir(path):
            continue  # no checkpoint, or a missing folder: ModelConfig.validate names it
        bert = read_bert_config(path)
        field = f"{prefix}.{section}.bert_checkpoint"
        if bert.get("hidden_act", "gelu") != "gelu":
            raise ConfigError(f"{field}: {path} uses hidden_act={bert['hidden_act']!r}; only 'gelu' is supported")
        for name in names:
            theirs = bert.get(BERT_SIZE_KEYS[name])
            if theirs is None or getattr(target, name) == theirs:
                continue
            if name in given:
                raise ConfigError(f"{prefix}.{section}.{name}: {getattr(target, name)} but {path} has "
                                  f"{BERT_SIZE_KEYS[name]}={theirs}; leave {section}.{name} unset to follow it")
            setattr(target, name, theirs)
        if section == "decoder" and bert.get("hidden_size") not in (None, t.width):
            raise ConfigError(f"{field}: {path} has hidden_size={bert['hidden_size']} but the decoder's width is "
                              f"the text width {t.width}")
        depth = bert.get("num_hidden_layers")
        if section == "text" and depth is not None and t.encoder_layers > depth:
            raise ConfigError(f"{prefix}.text.encoder_layers: {t.encoder_layers} > the {depth} layers of {path}")
