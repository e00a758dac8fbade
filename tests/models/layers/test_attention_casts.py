"""Under bf16 autocast, attention casts each fp32 input once (not once per Q, K and V projection), and a step's
fusion passes cast the image states once for the keys/values they share."""
from __future__ import annotations

import torch

from mplug_pretrain.models.layers.attention import MultiHeadAttention
from tests.models.dtype_casts import ActivationCasts

F32, BF16 = torch.float32, torch.bfloat16


def _forward_casts(module, *args, **kwargs):
    with ActivationCasts(module.parameters()) as counter, torch.autocast("cpu", dtype=BF16):
        module(*args, **kwargs)
    return counter.casts


def test_self_attention_casts_its_input_once():
    attn = MultiHeadAttention(32, 4)
    x = torch.randn(2, 5, 32)
    assert _forward_casts(attn, x) == [((2, 5, 32), F32, BF16)]


def test_cross_attention_casts_query_input_and_source_once_each():
    attn = MultiHeadAttention(32, 4)
    x, source = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    assert sorted(_forward_casts(attn, x, source=source)) == [((2, 5, 32), F32, BF16), ((2, 7, 32), F32, BF16)]


def test_without_autocast_nothing_is_cast():
    attn = MultiHeadAttention(32, 4)
    with ActivationCasts(attn.parameters()) as counter:
        attn(torch.randn(2, 5, 32), source=torch.randn(2, 7, 32))
    assert counter.casts == []


def test_fusion_passes_cast_the_image_states_once_per_segment_and_share_the_first_segment():
    """CCCXCC on fp32 image states (as a GPU's fp32 LayerNorm leaves them; CPU autocast keeps the ViT in bf16):
    the C layers up to the X layer share one cast, and with shared keys/values the ITM (3B rows) and MLM passes
    cast only the B image rows once for both; after the X layer each pass casts its own image stream once."""
    from collections import Counter

    from mplug_pretrain.models.fusion import SkipConnectedFusion
    torch.manual_seed(0)
    b, m, t, d = 2, 7, 4, 32
    fusion = SkipConnectedFusion(d, 4, 64, 6, 3, "code", 0.0)
    image, text = torch.randn(b, m, d), torch.randn(3 * b, t, d)
    mask, rows = torch.ones(3 * b, t, dtype=torch.long), torch.tensor([0, 1, 1, 0, 0, 1])

    def image_casts(shared: bool) -> Counter:
        with ActivationCasts(fusion.parameters()) as counter, torch.autocast("cpu", dtype=BF16):
            if shared:
                kv = fusion.image_keys_values(image)
                fusion(image, None, text, mask, image_rows=rows, image_kv=kv)  # ITM
                fusion(image, None, text[:b], mask[:b], image_kv=kv)  # MLM
            else:
                fusion(image[rows], None, text, mask)
                fusion(image, None, text[:b], mask[:b])
        return Counter(shape for shape, a, c in counter.casts if shape[1:] == (m, d) and (a, c) == (F32, BF16))

    assert image_casts(shared=True) == {(b, m, d): 2, (3 * b, m, d): 1}
    assert image_casts(shared=False) == {(b, m, d): 2, (3 * b, m, d): 2}
