"""StaticExpansionRefiner: Eq. 11 layer wiring, block static groups from the config, gradients, errors."""
import pytest
import torch

import mplug_pretrain  # noqa: F401
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.expansionnet.encoder import (
    StaticExpansionEncoderLayer,
    StaticExpansionRefiner,
)
from mplug_pretrain.models.model_config import VisualRefinerConfig


def test_encoder_layer_follows_eq_11():
    torch.manual_seed(0)
    layer = StaticExpansionEncoderLayer(8, (2, 3), 16, dropout=0.0).eval()
    x = torch.randn(2, 5, 8)
    e = x + layer.expansion(layer.norm_expansion(x))
    torch.testing.assert_close(layer(x), e + layer.ffn(layer.norm_ffn(e)))


def test_refiner_builds_groups_from_config_and_keeps_shape():
    block = StaticExpansionRefiner(VisualRefinerConfig("static_expansion", 2, 64, (2, 4, 8)), 16, 3)
    plain = StaticExpansionRefiner(VisualRefinerConfig("static_expansion", 1, 5, ()), 16, 3)
    assert [layer.expansion.group for layer in block.layers] == [(2, 4, 8)] * 2
    assert plain.layers[0].expansion.group == (5,)
    tokens = torch.randn(2, 10, 16)
    assert block(tokens).shape == plain(tokens).shape == tokens.shape


def test_every_parameter_receives_a_gradient():
    torch.manual_seed(1)
    refiner = StaticExpansionRefiner(VisualRefinerConfig("static_expansion", 2, 4, (2, 3)), 16, 2).train()
    refiner(torch.randn(2, 5, 16)).pow(2).sum().backward()
    missing = [n for n, p in refiner.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_bad_inputs_raise():
    refiner = StaticExpansionRefiner(VisualRefinerConfig("static_expansion", 1, 4), 16, 2)
    with pytest.raises(ValueError, match="CLS \\+ grid"):
        refiner(torch.randn(1, 4, 16))
    with pytest.raises(ConfigError, match="refiner.expansion_group"):
        StaticExpansionRefiner(VisualRefinerConfig("static_expansion", 1, 4, (4, 0)), 16, 2)
