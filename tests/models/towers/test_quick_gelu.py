"""QuickGELU is OpenAI CLIP's x * sigmoid(1.702 x) exactly (not GELU's tanh form), written as one expression that
a compiled block captures whole (one fused kernel under inductor); the ViT block around it has no graph break."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mplug_pretrain.models.towers.vision import QuickGELU, ResidualAttentionBlock


def test_quick_gelu_is_clips_function_not_the_tanh_gelu():
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    expected = x / (1 + torch.exp(-1.702 * x))
    torch.testing.assert_close(QuickGELU()(x), expected, rtol=1e-12, atol=1e-12)
    assert (QuickGELU()(x) - F.gelu(x, approximate="tanh")).abs().max() > 1e-2


def test_vit_block_compiles_without_graph_breaks():
    import torch._dynamo
    torch._dynamo.reset()
    block = ResidualAttentionBlock(32, 4, 4.0, "quick_gelu")
    explained = torch._dynamo.explain(block)(torch.randn(2, 5, 32))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
