"""ExpansionDecoder against the decoder_api contract: causality, incremental == full, beam reordering,
padding, bf16 autocast at the first causal position, gradients, parameter count."""
import pytest
import torch
import torch.nn.functional as F

import mplug_pretrain  # noqa: F401
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.expansionnet.decoder import ExpansionDecoder
from mplug_pretrain.models.model_config import DecoderConfig

VOCAB, WIDTH = 40, 16
CFG = DecoderConfig(type="expansion", layers=2, heads=2, ffn_dim=32, dropout=0.1, max_positions=24, expansion_slots=3)


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    return ExpansionDecoder(CFG, VOCAB, WIDTH).eval()


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
    other_ids[1, :2] = torch.tensor([5, 9])  # left-padding token contents
    other_memory[1, 3:] = 10 * torch.randn(2, WIDTH)  # masked memory slots
    other = decoder(other_ids, mask, other_memory, memory_mask).logits
    torch.testing.assert_close(other[1, 2:], logits[1, 2:], rtol=0, atol=1e-6)
    # right padding: the real prefix equals the unpadded run
    right = decoder(ids[:1], torch.tensor([[1] * 5 + [0] * 3]), memory[:1], memory_mask[:1]).logits
    torch.testing.assert_close(right[:, :5], decoder(ids[:1, :5], mask[:1, :5], memory[:1], memory_mask[:1]).logits,
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_first_causal_position_is_finite_under_autocast(decoder, batch, dtype):
    ids, mask, memory, memory_mask = batch
    with torch.autocast("cpu", dtype=dtype):
        first = decoder(ids[:, :1], mask[:, :1], memory, memory_mask, use_cache=True)
        second = decoder(ids[:, 1:2], mask[:, :2], memory, memory_mask, past=first.past)
        full = decoder(ids, mask, memory, memory_mask)
    for logits in (first.logits, second.logits, full.logits):
        assert torch.isfinite(logits.float()).all()


def test_every_parameter_receives_a_gradient(batch):
    torch.manual_seed(0)
    decoder = ExpansionDecoder(CFG, VOCAB, WIDTH).train()
    ids, mask, memory, memory_mask = batch
    logits = decoder(ids, mask, memory, memory_mask).logits
    F.cross_entropy(logits.reshape(-1, VOCAB), torch.roll(ids, -1, 1).reshape(-1)).backward()
    missing = [n for n, p in decoder.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def expected_parameter_count(cfg: DecoderConfig, vocab: int, d: int) -> int:
    linear = d * d + d
    per_layer = (5 * linear + 2 * cfg.expansion_slots * d  # C, K, V1, V2, S + E_Q, E_B
                 + 4 * linear  # cross-attention
                 + 2 * d * cfg.ffn_dim + cfg.ffn_dim + d  # FF
                 + 3 * 2 * d)  # three LayerNorms
    combination = cfg.layers * d * d + d + 2 * d
    head = vocab + (0 if cfg.tie_word_embeddings else vocab * d)
    return vocab * d + cfg.max_positions * d + cfg.layers * per_layer + combination + head


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_the_architecture(tie):
    cfg = DecoderConfig(type="expansion", layers=3, heads=2, ffn_dim=24, max_positions=10, expansion_slots=4,
                        tie_word_embeddings=tie)
    decoder = ExpansionDecoder(cfg, 30, 8)
    assert sum(p.numel() for p in decoder.parameters()) == expected_parameter_count(cfg, 30, 8)
    assert (decoder.lm_head.weight is decoder.embedding.token.weight) == tie


def test_bad_inputs_raise_clear_errors(decoder, batch):
    ids, mask, memory, memory_mask = batch
    with pytest.raises(ValueError, match="attention_mask"):
        decoder(ids, mask[:, :5], memory, memory_mask)
    with pytest.raises(ValueError, match="max_positions"):
        decoder(torch.ones(1, 30, dtype=torch.long), torch.ones(1, 30), memory[:1], memory_mask[:1])
    with pytest.raises(ConfigError, match="decoder.heads"):
        ExpansionDecoder(DecoderConfig(heads=3), VOCAB, WIDTH)
