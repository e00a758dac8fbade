"""ACFDecoder: stacked clustering rows growing across layers (Eq. 5) and the parameter count (the decoder_api
contract: tests/models/decoders/test_decoder_contract.py)."""
import itertools

import pytest
import torch

import mplug_pretrain  # noqa: F401
from mplug_pretrain.models.decoders.acf.decoder import ACFDecoder
from mplug_pretrain.models.model_config import DecoderConfig

VOCAB, WIDTH = 40, 16
CFG = DecoderConfig(type="acf", layers=3, heads=2, ffn_dim=32, dropout=0.1, max_positions=24)


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    return ACFDecoder(CFG, VOCAB, WIDTH).eval()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    memory = torch.randn(3, 5, WIDTH, generator=g)
    memory_mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    return ids, mask, memory, memory_mask


def test_stacked_clustering_grows_across_layers(decoder, batch):
    ids, mask, memory, memory_mask = batch
    captured = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: captured.append(out[1])) for layer in decoder.layers]
    try:
        decoder(ids, mask, memory, memory_mask)
    finally:
        for hook in hooks:
            hook.remove()
    causal = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    for rows in captured:
        assert rows.shape == (3, 8, 8)
        assert (rows[:, ~causal] == 0).all() and (rows[:, causal] <= 1 + 1e-6).all()
        torch.testing.assert_close(torch.diagonal(rows, dim1=-2, dim2=-1), torch.ones(3, 8))
    for before, after in itertools.pairwise(captured):
        assert (after >= before - 1e-6).all()
        assert (after > before + 1e-3).any()


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_the_architecture(tie):
    d, f, vocab = 8, 24, 30
    cfg = DecoderConfig(type="acf", layers=3, heads=2, ffn_dim=f, max_positions=10, tie_word_embeddings=tie)
    per_layer = (2 * d + 1  # FC([s_k, mean]) -> 1
                 + 4 * (d * d + d)  # self-attention q, k, v, out
                 + 4 * (d * d + d)  # cross-attention
                 + 2 * d * f + f + d  # FF
                 + 3 * 2 * d)  # three LayerNorms
    expected = vocab * d + 10 * d + 3 * per_layer + vocab + (0 if tie else vocab * d)
    assert sum(p.numel() for p in ACFDecoder(cfg, vocab, d).parameters()) == expected
