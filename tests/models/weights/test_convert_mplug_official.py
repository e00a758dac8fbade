"""Official mPLUG key names -> ours, on a synthetic official state dict of the tiny preset's shapes.

The official names are produced by the real classes the official model is built from (open_clip's CLIP for
``visual_encoder``, transformers' BertModel / BertLMHeadModel / BertForMaskedLM for the BERT parts).
"""
from __future__ import annotations

import open_clip
import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, BertLMHeadModel, BertModel

from mplug_pretrain.models.presets import build_model
from mplug_pretrain.models.weights.mplug_official import (
    convert_official_state_dict,
    describe,
    load_official_checkpoint,
)

K, F, WIDTH, Q, E = 2, 2, 128, 1024, 256  # tiny preset


def _prefixed(prefix, module):
    return {prefix + k: v.clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def official():
    torch.manual_seed(0)
    bert = {"vocab_size": 30522, "hidden_size": WIDTH, "num_attention_heads": 2, "intermediate_size": 512,
                "max_position_embeddings": 512}
    clip = open_clip.CLIP(embed_dim=64, quick_gelu=True,
                          vision_cfg={"image_size": 64, "patch_size": 8, "width": WIDTH, "layers": 2, "head_width": 64},
                          text_cfg={"context_length": 8, "vocab_size": 64, "width": 64, "heads": 1, "layers": 1})
    text = BertModel(BertConfig(num_hidden_layers=K, **bert), add_pooling_layer=False)
    fusion = BertModel(BertConfig(num_hidden_layers=K + F, is_decoder=True, add_cross_attention=True, **bert),
                       add_pooling_layer=False)
    decoder = BertLMHeadModel(BertConfig(num_hidden_layers=2, is_decoder=True, add_cross_attention=True, **bert))
    mlm = BertForMaskedLM(BertConfig(num_hidden_layers=1, **bert))
    sd = {}
    for prefix, module in (("visual_encoder.", clip), ("visual_encoder_m.", clip), ("text_encoder.", text),
                           ("text_encoder_m.", text), ("fusion_encoder.", fusion), ("fusion_encoder_m.", fusion),
                           ("text_decoder.", decoder), ("text_encoder.cls.", mlm.cls)):
        sd.update(_prefixed(prefix, module))
    for name in ("vision_proj", "text_proj", "vision_proj_m", "text_proj_m"):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = torch.randn(E, WIDTH), torch.randn(E)
    sd.update({"temp": torch.tensor(0.05), "image_queue": torch.randn(E, Q), "text_queue": torch.randn(E, Q),
               "idx_queue": torch.arange(Q)[None], "queue_ptr": torch.tensor([3]),
               "itm_head.weight": torch.randn(2, WIDTH), "itm_head.bias": torch.randn(2),
               "brand_new_head.weight": torch.randn(3)})
    return sd


def test_synthetic_official_checkpoint_loads_strictly(official, tmp_path):
    model = build_model("tiny")
    result = convert_official_state_dict(official, model)
    assert result.unknown == ["brand_new_head.weight"]
    assert result.missing == []
    model.load_state_dict(result.state_dict, strict=True)
    own = dict(model.state_dict())
    assert torch.equal(own["fusion.layers.0.cross_attn.key.weight"],
                       official[f"fusion_encoder.encoder.layer.{K}.crossattention.self.key.weight"])
    assert torch.equal(own["fusion.layers.1.ffn_norm.bias"], official[f"fusion_encoder.encoder.layer.{K + 1}.output.LayerNorm.bias"])
    assert torch.equal(own["image_encoder_m.vit.transformer.resblocks.1.attn.in_proj_weight"],
                       official["visual_encoder_m.visual.transformer.resblocks.1.attn.in_proj_weight"])
    assert torch.equal(own["decoder.head.transform.weight"], official["text_decoder.cls.predictions.transform.dense.weight"])
    assert torch.equal(own["mlm_head.norm.bias"], official["text_encoder.cls.predictions.transform.LayerNorm.bias"])
    assert torch.equal(own["itm_head.linear.weight"], official["itm_head.weight"])
    assert int(model.itc.queue_count) == Q and int(model.itc.queue_ptr) == 3
    assert "CLIP text tower" in result.ignored["visual_encoder.token_embedding.weight"]
    assert "below" in result.ignored["fusion_encoder.encoder.layer.0.attention.self.query.weight"]
    # tiny fusion is C X: the connected layer's official cross-attention is never run
    assert "connected" in result.ignored[f"fusion_encoder.encoder.layer.{K + 1}.crossattention.self.query.weight"]
    assert "brand_new_head.weight" in describe(result)

    path = tmp_path / "mplug_tiny.pth"
    torch.save({"model": official, "epoch": 3}, path)
    reloaded = build_model("tiny")
    load_official_checkpoint(reloaded, str(path), strict=True, stride=1)
    assert reloaded.itc.temp.item() == official["temp"].item()


def test_missing_and_mismatched_parts_are_reported(official):
    model = build_model("tiny", **{"heads.queue_size": 512})
    partial = {k: v for k, v in official.items() if not k.startswith("text_decoder.")}
    result = convert_official_state_dict(partial, model)
    assert any(k.startswith("decoder.layers.0.") for k in result.missing)
    assert "queue size" in result.ignored["image_queue"] and "itc.queue_count" in result.missing
    with pytest.raises(RuntimeError):
        model.load_state_dict(result.state_dict, strict=True)


def test_stride_or_width_of_another_model_is_refused_before_loading(official, tmp_path):
    config = tmp_path / "config_bert_stride3.json"
    config.write_text(f'{{"hidden_size": {WIDTH}, "stride_layer": 3}}')
    model = build_model("tiny")  # 2 fusion layers at stride 1: C X; stride 3 would be C C
    before = model.fusion.layers[0].ffn_norm.weight.clone()
    with pytest.raises(ValueError, match="stride 3 .*model.fusion.stride=3"):
        load_official_checkpoint(model, official, official_config=str(config))
    with pytest.raises(ValueError, match="width 768"):
        load_official_checkpoint(model, official, official_config={"hidden_size": 768, "stride_layer": 1})
    assert torch.equal(model.fusion.layers[0].ffn_norm.weight, before)  # nothing loaded
    with pytest.warns(UserWarning, match="stride not checked"):
        load_official_checkpoint(model, official)
    load_official_checkpoint(model, official, official_config={"hidden_size": WIDTH, "stride_layer": 1})


def test_momentum_encoders_absent_from_the_checkpoint_start_as_online_copies(official):
    caption_only = {k: v for k, v in official.items()
                    if not k.startswith(("visual_encoder_m.", "text_encoder_m.", "vision_proj_m.", "text_proj_m."))}
    model = build_model("tiny")
    result = load_official_checkpoint(model, caption_only, stride=1)
    assert len(result.momentum_from_online) == sum("_m." in k for k in model.state_dict())
    own = model.state_dict()
    for key in result.momentum_from_online:
        assert torch.equal(own[key], own[key.replace("_m.", ".", 1)]), key
    assert torch.equal(own["image_encoder_m.vit.conv1.weight"], official["visual_encoder.visual.conv1.weight"])
    assert "momentum copied from the online weights" in describe(result)
