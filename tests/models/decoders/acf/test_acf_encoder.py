"""ACFVisualRefiner: shapes, stacked 2-D clustering over the patch grid with an explicit CLS token,
gradients and input errors."""
import itertools

import pytest
import torch

import mplug_pretrain  # noqa: F401
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.acf.encoder import ACFVisualRefiner
from mplug_pretrain.models.model_config import VisualRefinerConfig

CFG = VisualRefinerConfig(type="acf", layers=3)


def test_stacked_clusters_grow_across_layers_and_cls_is_global():
    torch.manual_seed(0)
    refiner = ACFVisualRefiner(CFG, 16, 3, heads=2).eval()
    tokens = torch.randn(2, 10, 16)
    out, stacked = refiner(tokens, return_clusters=True)
    assert out.shape == tokens.shape and len(stacked) == 3
    for c in stacked:
        assert c.shape == (2, 10, 10)
        torch.testing.assert_close(c, c.transpose(-1, -2))
        torch.testing.assert_close(torch.diagonal(c, dim1=-2, dim2=-1), torch.ones(2, 10))
        assert (c >= 0).all() and (c <= 1 + 1e-6).all()
        assert (c[:, 0] == 1).all() and (c[:, :, 0] == 1).all()
    for before, after in itertools.pairwise(stacked):
        assert (after >= before - 1e-6).all()
        assert (after > before + 1e-3).any()
    # the first layer's matrix comes from the input grid: patches (0,0) and (0,1) are horizontal neighbours
    grid = tokens[:, 1:].reshape(2, 3, 3, 16)
    fc = refiner.layers[0].clusters.horizontal.fc
    neighbour = torch.sigmoid(fc(torch.cat([grid[:, 0, 1], grid[:, 0, 0]], -1)))[:, 0]
    torch.testing.assert_close(stacked[0][:, 1, 2], neighbour)


def test_down_up_sampling_gives_block_constant_clusters():
    torch.manual_seed(1)
    refiner = ACFVisualRefiner(VisualRefinerConfig(type="acf", layers=1), 16, 4, heads=2, down_up_rate=2).eval()
    _, (c,) = refiner(torch.randn(1, 17, 16), return_clusters=True)
    patches = c[0, 1:, 1:]
    assert patches[0, 1] == 1 and patches[0, 4] == 1 and patches[0, 5] == 1  # same 2x2 cell as patch 0
    torch.testing.assert_close(patches[0, 2], patches[1, 3])  # cells (0,0) and (0,1) from any members


def test_every_parameter_receives_a_gradient():
    torch.manual_seed(2)
    refiner = ACFVisualRefiner(CFG, 16, 3, heads=2).train()
    refiner(torch.randn(2, 10, 16)).pow(2).sum().backward()
    missing = [n for n, p in refiner.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_bad_inputs_raise():
    refiner = ACFVisualRefiner(CFG, 16, 3, heads=2)
    with pytest.raises(ValueError, match="CLS \\+ grid"):
        refiner(torch.randn(1, 9, 16))
    with pytest.raises(ConfigError, match="down_up_rate"):
        ACFVisualRefiner(CFG, 16, 3, heads=2, down_up_rate=2)
    with pytest.raises(ConfigError, match="heads"):
        ACFVisualRefiner(CFG, 16, 3, heads=3)
