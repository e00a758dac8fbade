"""Fusion schedules (both rules), the untouched image stream, and each design against a hand-written reference."""
from __future__ import annotations

import pytest
import torch

from mplug_pretrain.models.fusion import (
    AllConnectedFusion,
    SkipConnectedFusion,
    TwoStreamFusion,
    fusion_schedule,
    schedule_pattern,
)

# Patterns from the paper digest's table (Algorithm 1) and DESIGN.md (released code), 6 fusion layers.
EXPECTED = {
    ("code", 1): "CXXXXX", ("code", 2): "CCXCXC", ("code", 3): "CCCXCC", ("code", 6): "CCCCCC",
    ("paper", 1): "CXCXCX", ("paper", 2): "CCXCCX", ("paper", 3): "CCCXCC", ("paper", 6): "CCCCCC",
}
W, H, FFN = 32, 4, 64


@pytest.mark.parametrize("rule,stride", sorted(EXPECTED))
def test_schedule_patterns(rule, stride):
    assert schedule_pattern(fusion_schedule(6, stride, rule)) == EXPECTED[(rule, stride)]


def test_schedule_rejects_bad_input():
    with pytest.raises(ValueError):
        fusion_schedule(6, 0, "code")
    with pytest.raises(ValueError):
        fusion_schedule(6, 3, "alg1")


def _inputs(b=2, m=5, t=4):
    g = torch.Generator().manual_seed(0)
    image, text = torch.randn(b, m, W, generator=g), torch.randn(b, t, W, generator=g)
    text_mask = torch.ones(b, t, dtype=torch.long)
    text_mask[1, -1] = 0
    return image, text, text_mask


def test_connected_layers_have_no_cross_attention():
    fusion = SkipConnectedFusion(W, H, FFN, 6, 3, "code", 0.0)
    assert [layer.cross_attn is None for layer in fusion.layers] == [c == "X" for c in "CCCXCC"]


def test_image_stream_untouched_without_connected_layers():
    torch.manual_seed(0)
    fusion = SkipConnectedFusion(W, H, FFN, 6, 6, "code", 0.0).eval()
    image, text, text_mask = _inputs()
    with torch.no_grad():
        image_out, text_out = fusion(image, None, text, text_mask)
    assert torch.equal(image_out, image)
    assert not torch.allclose(text_out, text)


@pytest.mark.parametrize("rule", ["code", "paper"])
def test_skip_connected_matches_reference(rule):
    """S = 2: image only changes at X layers (image += X-layer image output); text follows every layer."""
    torch.manual_seed(0)
    fusion = SkipConnectedFusion(W, H, FFN, 6, 2, rule, 0.0).eval()
    image, text, text_mask = _inputs()
    text_bias = torch.zeros(2, 1, 1, 4).masked_fill(text_mask[:, None, None, :] == 0, torch.finfo(torch.float32).min)
    joint_bias = torch.cat([torch.zeros(2, 1, 1, 5), text_bias], dim=-1)
    v, l = image.clone(), text.clone()
    with torch.no_grad():
        for layer, kind in zip(fusion.layers, EXPECTED[(rule, 2)]):
            if kind == "C":
                before = v.clone()
                l = layer(l, text_bias, v, None)
                assert torch.equal(v, before)
            else:
                out = layer(torch.cat([v, l], 1), joint_bias)
                v, l = v + out[:, :5], out[:, 5:]
        image_out, text_out = fusion(image, None, text, text_mask)
    assert torch.allclose(image_out, v, atol=1e-6) and torch.allclose(text_out, l, atol=1e-6)


def test_all_connected_is_one_stream():
    torch.manual_seed(0)
    fusion = AllConnectedFusion(W, H, FFN, 3, 0.0).eval()
    image, text, text_mask = _inputs()
    with torch.no_grad():
        x = torch.cat([image, text], 1)
        bias = torch.cat([torch.zeros(2, 5), torch.zeros(2, 4).masked_fill(text_mask == 0, -1e30)], 1)[:, None, None]
        for layer in fusion.layers:
            x = layer(x, bias)
        image_out, text_out = fusion(image, None, text, text_mask)
    assert torch.allclose(image_out, x[:, :5], atol=1e-5) and torch.allclose(text_out, x[:, 5:], atol=1e-5)


def test_two_stream_updates_both_streams_from_previous_states():
    torch.manual_seed(0)
    fusion = TwoStreamFusion(W, H, FFN, 2, 0.0).eval()
    image, text, text_mask = _inputs()
    text_mask[:] = 1
    with torch.no_grad():
        v, l = image, text
        for text_layer, image_layer in zip(fusion.layers, fusion.image_layers):
            v, l = image_layer(v, None, l, None), text_layer(l, None, v, None)
        image_out, text_out = fusion(image, None, text, text_mask)
    assert torch.allclose(image_out, v, atol=1e-5) and torch.allclose(text_out, l, atol=1e-5)


@pytest.mark.parametrize("make", [lambda: SkipConnectedFusion(W, H, FFN, 4, 2, "code", 0.0),
                                  lambda: AllConnectedFusion(W, H, FFN, 2, 0.0),
                                  lambda: TwoStreamFusion(W, H, FFN, 2, 0.0)])
def test_text_padding_is_invisible(make):
    torch.manual_seed(0)
    fusion = make().eval()
    image, text, _ = _inputs(t=4)
    mask = torch.ones(2, 4, dtype=torch.long)
    padded = torch.cat([text, torch.randn(2, 3, W)], 1)
    padded_mask = torch.cat([mask, torch.zeros(2, 3, dtype=torch.long)], 1)
    with torch.no_grad():
        v1, l1 = fusion(image, None, text, mask)
        v2, l2 = fusion(image, None, padded, padded_mask)
    assert torch.allclose(v1, v2, atol=1e-5) and torch.allclose(l1, l2[:, :4], atol=1e-5)
