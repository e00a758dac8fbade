"""ACFDecoder against the decoder_api contract: causality, incremental == full, beam reordering,
padding, stacked clustering rows growing across layers, bf16 autocast, gradients, parameter count."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import mplug_pretrain  # noqa: F401
from mplug_pretrain.models.acf.decoder import ACFDecoder
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


def test_changing_a_future_token_never_changes_earlier_logits(decoder, batch):
    ids, mask, memory, memory_mask = batch
    logits = decoder(ids, mask, memory, memory_mask).logits
    for t in (1, 4, 7):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 7) % VOCAB
        other = decoder(changed, mask, memory, memory_mask).logits
        torch.testing.assert_close(other[:, :t], logits[:, :t], rtol=0, atol=0)
        assert not torch.allclose(other[:, t], logits[:, t])


def test_incremental_equals_full(decoder, batch):
    ids, mask, memory, memory_mask = batch
    full = decoder(ids, mask, memory, memory_mask).logits
    out = decoder(ids[:, :3], mask[:, :3], memory, memory_mask, use_cache=True)
    parts, past = [out.logits], out.past
    for t in range(3, 8):
        out = decoder(ids[:, t:t + 1], mask[:, :t + 1], memory, memory_mask, past=past, use_cache=True)
        parts.append(out.logits)
        past = out.past
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)


def test_reorder_cache_selects_and_repeats_rows(decoder, batch):
    ids, mask, memory, memory_mask = batch
    index = torch.tensor([2, 2, 0, 1])
    full = decoder(ids[index], mask[index], memory[index], memory_mask[index]).logits
    out = decoder(ids[:, :5], mask[:, :5], memory, memory_mask, use_cache=True)
    past = decoder.reorder_cache(out.past, index)
    step = decoder(ids[index, 5:], mask[index], memory[index], memory_mask[index], past=past).logits
    torch.testing.assert_close(step, full[:, 5:], rtol=0, atol=1e-5)


def test_padding_does_not_change_real_positions(decoder, batch):
    ids, mask, memory, memory_mask = batch
    logits = decoder(ids, mask, memory, memory_mask).logits
    other_ids, other_memory = ids.clone(), memory.clone()
    other_ids[1, :2] = torch.tensor([5, 9])
    other_memory[1, 3:] = 10 * torch.randn(2, WIDTH)
    other = decoder(other_ids, mask, other_memory, memory_mask).logits
    torch.testing.assert_close(other[1, 2:], logits[1, 2:], rtol=0, atol=1e-6)
    assert torch.isfinite(other).all()  # padding queries still see themselves: no empty softmax row
    right = decoder(ids[:1], torch.tensor([[1] * 5 + [0] * 3]), memory[:1], memory_mask[:1]).logits
    torch.testing.assert_close(right[:, :5], decoder(ids[:1, :5], mask[:1, :5], memory[:1], memory_mask[:1]).logits,
                               rtol=0, atol=1e-6)


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


def test_first_causal_position_is_finite_under_bf16_autocast(decoder, batch):
    ids, mask, memory, memory_mask = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = decoder(ids[:, :1], mask[:, :1], memory, memory_mask, use_cache=True)
        second = decoder(ids[:, 1:2], mask[:, :2], memory, memory_mask, past=first.past)
    assert torch.isfinite(first.logits.float()).all() and torch.isfinite(second.logits.float()).all()


def test_every_parameter_receives_a_gradient(batch):
    torch.manual_seed(0)
    decoder = ACFDecoder(CFG, VOCAB, WIDTH).train()
    ids, mask, memory, memory_mask = batch
    logits = decoder(ids, mask, memory, memory_mask).logits
    F.cross_entropy(logits.reshape(-1, VOCAB), torch.roll(ids, -1, 1).reshape(-1)).backward()
    missing = [n for n, p in decoder.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


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
