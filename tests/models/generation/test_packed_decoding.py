"""``packed_for_decoding``: every decoder head decodes the same captions with packed weights as without, the packed
copies live only inside the block, and the block steps aside wherever packing would be wrong (training mode,
autograd, bf16, autocast, no MKL)."""
from __future__ import annotations

import pytest
import torch

from mplug_pretrain.models.decoders.factory import build_decoder
from mplug_pretrain.models.generation import decoding as G
from mplug_pretrain.models.generation.packed_decoding import (
    PackedProduct,
    packed_for_decoding,
    packing_available,
)
from mplug_pretrain.models.model_config import DecoderConfig

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no MKL packed GEMM")

VOCAB, WIDTH = 130, 32  # BOS is id 101
KINDS = {"bert": {"type": "bert"}, "expansion": {"type": "expansion", "expansion_slots": 3},
         "acf": {"type": "acf", "acf_formula": "paper"}}


def make_decoder(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = DecoderConfig(layers=2, heads=4, ffn_dim=64, max_positions=24, **KINDS[kind])
    return build_decoder(cfg, vocab_size=VOCAB, width=WIDTH).eval()


def memory(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, 7, dtype=torch.long)
    mask[0, -2:] = 0
    return torch.randn(rows, 7, WIDTH, generator=g), mask


def products(module: torch.nn.Module) -> list[PackedProduct]:
    return [m.product for m in module.modules() if isinstance(getattr(m, "product", None), PackedProduct)]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("beam", [1, 3])
def test_packed_beam_search_equals_plain_over_batches_of_two_sizes(kind, beam):
    """A pass of two batches, the second smaller (its products fall back to the plain ones)."""
    decoder = make_decoder(kind)
    batches = [memory(4, seed=1), memory(3, seed=2)]
    plain = [G.beam_search(decoder, m, mask, beam_size=beam, max_length=9) for m, mask in batches]
    with torch.no_grad(), packed_for_decoding(decoder) as fast:
        assert fast is not decoder
        packed = [G.beam_search(fast, m, mask, beam_size=beam, max_length=9) for m, mask in batches]
        used = [p for p in products(fast) if p.packed is not None]
        assert used and {p.rows for p in used} >= {4 * beam}  # the steps' row count was packed
    for a, b in zip(plain, packed):
        assert torch.equal(a.sequences, b.sequences)
        torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=1e-5)


def test_an_empty_input_packs_nothing_and_the_next_one_packs_for_its_rows():
    torch.manual_seed(0)
    linear = torch.nn.Linear(WIDTH, 5).eval()
    x = torch.randn(3, WIDTH)
    with torch.no_grad(), packed_for_decoding(linear) as fast:
        assert fast(torch.empty(0, WIDTH)).shape == (0, 5) and fast.product.packed is None
        torch.testing.assert_close(fast(x), linear(x), rtol=0, atol=1e-6)
        assert fast.product.packed is not None and fast.product.rows == 3


def test_the_packed_copies_live_only_inside_the_block_and_share_the_parameters():
    decoder = make_decoder("bert")
    keys = set(decoder.state_dict())
    m, mask = memory(2)
    with torch.no_grad(), packed_for_decoding(decoder) as fast:
        G.greedy_search(fast, m, mask, max_length=5)
        assert all(a is b for a, b in zip(fast.parameters(), decoder.parameters()))
    assert set(decoder.state_dict()) == keys
    assert products(fast) and all(p.packed is None for p in products(fast))
    with torch.no_grad():  # weights changed after the block (the tied vocabulary matrix was packed inside it)
        decoder.embeddings.word_embeddings.weight.mul_(1.5)
        decoder.layers[0].ffn_in.weight.mul_(-1.0)
        ids, step_mask = torch.full((2, 1), 101), torch.ones(2, 1, dtype=torch.long)
        torch.testing.assert_close(fast(ids, step_mask, m, mask).logits, decoder(ids, step_mask, m, mask).logits,
                                   rtol=0, atol=0)


def test_under_autograd_the_block_computes_plain_differentiable_products():
    decoder = make_decoder("bert")
    m, mask = memory(2)
    ids, ids_mask = torch.randint(1, VOCAB, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    decoder(ids, ids_mask, m, mask).logits.square().mean().backward()
    expected = [p.grad.clone() for p in decoder.parameters()]
    decoder.zero_grad()
    with packed_for_decoding(decoder) as fast:
        fast(ids, ids_mask, m, mask).logits.square().mean().backward()
        assert all(p.packed is None for p in products(fast))
    for want, p in zip(expected, decoder.parameters()):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=0)


def test_the_block_steps_aside_where_packing_does_not_apply():
    decoder = make_decoder("bert")
    with packed_for_decoding(decoder.train()) as fast:
        assert fast is decoder
    with packed_for_decoding(make_decoder("bert").to(torch.bfloat16)) as fast:
        assert not products(fast)
    decoder.eval()
    m, mask = memory(2)
    with torch.no_grad(), packed_for_decoding(decoder) as fast, torch.autocast("cpu", dtype=torch.bfloat16):
        G.greedy_search(fast, m, mask, max_length=3)
        assert all(p.packed is None for p in products(fast))
