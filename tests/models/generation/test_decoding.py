"""Greedy / beam search / sampling / scoring against brute-force or teacher-forced recomputation."""
from __future__ import annotations

import itertools

import pytest
import torch

from mplug_pretrain.models.decoders.api import BOS_ID, EOS_ID, PAD_ID
from mplug_pretrain.models.decoders.bert import BertDecoder
from mplug_pretrain.models.generation import decoding as G
from mplug_pretrain.models.model_config import DecoderConfig

V, W = 110, 32


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    decoder = BertDecoder(DecoderConfig(layers=2, heads=4, ffn_dim=64, max_positions=40), vocab_size=V, width=W).eval()
    with torch.no_grad():  # make EOS likely enough that sequences end at different lengths
        decoder.head.bias[EOS_ID] = 3.0
    g = torch.Generator().manual_seed(1)
    memory = torch.randn(3, 5, W, generator=g)
    memory_mask = torch.ones(3, 5, dtype=torch.long)
    memory_mask[2, -1] = 0
    return decoder, memory, memory_mask


def teacher_forced(decoder, memory, memory_mask, sequences):
    with torch.no_grad():
        return G.sequence_log_probs(decoder, memory, memory_mask, sequences)


def test_beam_one_equals_greedy(setup):
    decoder, memory, memory_mask = setup
    greedy = G.greedy_search(decoder, memory, memory_mask, max_length=12, min_length=2)
    beam = G.beam_search(decoder, memory, memory_mask, beam_size=1, max_length=12, min_length=2)
    assert torch.equal(beam.sequences[:, 0], greedy)


def test_greedy_tokens_are_argmax_of_full_recomputation(setup):
    decoder, memory, memory_mask = setup
    seqs = G.greedy_search(decoder, memory, memory_mask, max_length=8)
    with torch.no_grad():
        for b in range(3):
            prefix = [BOS_ID]
            for token in seqs[b].tolist():
                if token == PAD_ID:
                    break
                ids = torch.tensor([prefix])
                logits = decoder(ids, torch.ones_like(ids), memory[b:b + 1], memory_mask[b:b + 1]).logits[0, -1]
                logits[PAD_ID] = float("-inf")
                assert token == int(logits.argmax())
                prefix.append(token)


def test_beam_search_is_exact_on_a_tiny_vocabulary():
    """With vocabulary 4 (PAD, two words, EOS) and 3 steps, a beam as wide as the search space is exhaustive."""
    torch.manual_seed(0)
    decoder = BertDecoder(DecoderConfig(layers=1, heads=2, ffn_dim=16, max_positions=8), vocab_size=110, width=8).eval()
    with torch.no_grad():  # only ids 5, 6 and EOS are possible
        decoder.head.bias.fill_(-1e4)
        decoder.head.bias[[5, 6, EOS_ID]] = 0.0
    memory, memory_mask = torch.randn(1, 3, 8), torch.ones(1, 3, dtype=torch.long)
    out = G.beam_search(decoder, memory, memory_mask, beam_size=9, max_length=3, length_penalty=0.0, num_return=3)
    candidates = []
    for n in range(1, 4):
        for words in itertools.product([5, 6, EOS_ID], repeat=n):
            if EOS_ID in words[:-1] or (n < 3 and words[-1] != EOS_ID):
                continue  # a finished sequence ends at its first EOS or at max_length
            seq = torch.tensor([list(words) + [PAD_ID] * (3 - n)])
            candidates.append((teacher_forced(decoder, memory, memory_mask, seq).item(), seq))
    candidates.sort(key=lambda c: -c[0])
    for rank in range(3):
        assert abs(out.scores[0, rank].item() - candidates[rank][0]) < 1e-4
        assert torch.equal(out.sequences[0, rank], candidates[rank][1][0])


def test_beam_scores_are_length_normalized_log_probs(setup):
    decoder, memory, memory_mask = setup
    out = G.beam_search(decoder, memory, memory_mask, beam_size=4, max_length=10, num_return=4, length_penalty=1.0)
    assert bool((out.scores[:, :-1] >= out.scores[:, 1:]).all())
    flat = out.sequences.reshape(12, -1)
    lp = teacher_forced(decoder, memory.repeat_interleave(4, 0), memory_mask.repeat_interleave(4, 0), flat)
    lengths = G.token_mask(flat).sum(1).float()
    assert torch.allclose(lp / lengths, out.scores.reshape(-1), atol=1e-4)


def test_sampling_log_probs_match_teacher_forcing_and_keep_gradient(setup):
    decoder, memory, memory_mask = setup
    seqs, lp = G.sample(decoder, memory, memory_mask, num_samples=4, max_length=9, top_k=20, top_p=0.9,
                        generator=torch.Generator().manual_seed(0))
    assert seqs.shape[0] == 12
    mem, mask = memory.repeat_interleave(4, 0), memory_mask.repeat_interleave(4, 0)
    with_grad = G.sequence_log_probs(decoder, mem, mask, seqs)
    assert with_grad.requires_grad
    assert torch.allclose(with_grad.detach(), lp, atol=1e-4)
    with_grad.sum().backward()
    assert decoder.layers[0].cross_attn.query.weight.grad is not None
    decoder.zero_grad()


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(G._filter_logits(logits, 2, 1.0)[0, 2:]).all()
    probs = logits.softmax(-1)[0]  # 0.644, 0.237, 0.087, 0.032
    kept = torch.isfinite(G._filter_logits(logits, 0, 0.85)[0])
    assert kept.tolist() == [True, True, False, False] and probs[:2].sum() >= 0.85


def test_candidate_scores_match_teacher_forcing(setup):
    decoder, memory, memory_mask = setup
    answers = torch.tensor([[BOS_ID, 7, EOS_ID, 0], [BOS_ID, 8, 9, EOS_ID], [BOS_ID, 10, EOS_ID, 0]])
    answer_mask = (answers != 0).long()
    order, scores = G.score_candidates(decoder, memory, memory_mask, answers, answer_mask, chunk_size=4)
    for b in range(3):
        direct = teacher_forced(decoder, memory[b:b + 1].expand(3, -1, -1), memory_mask[b:b + 1].expand(3, -1),
                                answers[:, 1:])
        assert torch.allclose(scores[b], direct[order[b]], atol=1e-4)
        assert order[b, 0] == direct.argmax()
    top_order, _top_scores = G.score_candidates(decoder, memory, memory_mask, answers, answer_mask, k=2)
    assert top_order.shape == (3, 2)


def test_draw_follows_the_distribution_and_never_draws_zero_probability():
    """Inverse-CDF draws vs the exact probabilities: frequencies within 4 standard errors over 40,000 draws,
    and no draw ever lands on a zero-probability index (three of them, including the first and last)."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    rows = probs.expand(40_000, -1).contiguous()
    drawn = G.draw(rows, torch.Generator().manual_seed(0))
    counts = torch.bincount(drawn, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * rows.shape[0]
    standard_error = (expected * (1 - probs.double())).sqrt()
    assert ((counts - expected).abs() <= 4 * standard_error + 1e-9).all(), (counts, expected)


class _PerRowMemory(torch.nn.Module):
    """The same decoder, made to take a memory row per decoder row (``memory_rows_shared`` off): what decoding
    did before memory rows were shared."""

    memory_rows_shared = False

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, *args, **kwargs):
        return self.decoder(*args, **kwargs)

    def reorder_cache(self, past, index):
        return self.decoder.reorder_cache(past, index)


@pytest.mark.parametrize("beam", [1, 3, 5])
def test_beams_sharing_one_memory_row_find_what_per_beam_memory_finds(setup, beam):
    decoder, memory, memory_mask = setup
    assert decoder.memory_rows_shared
    shared = G.beam_search(decoder, memory, memory_mask, beam_size=beam, max_length=10, num_return=beam)
    per_row = G.beam_search(_PerRowMemory(decoder), memory, memory_mask, beam_size=beam, max_length=10,
                            num_return=beam)
    assert torch.equal(shared.sequences, per_row.sequences)
    torch.testing.assert_close(shared.scores, per_row.scores, rtol=0, atol=1e-5)


def test_shared_memory_rows_in_sampling_and_teacher_forcing_give_equal_values_and_gradients(setup):
    decoder, memory, memory_mask = setup
    k = 4
    draws = [G.sample(d, memory, memory_mask, num_samples=k, max_length=8, generator=torch.Generator().manual_seed(3))
             for d in (decoder, _PerRowMemory(decoder))]
    assert torch.equal(draws[0][0], draws[1][0])
    torch.testing.assert_close(draws[0][1], draws[1][1], rtol=0, atol=1e-5)
    sequences = draws[0][0]
    grads, values = [], []
    for shared in (True, False):
        source = memory.clone().requires_grad_(True)
        rows = (source, memory_mask) if shared else (source.repeat_interleave(k, 0), memory_mask.repeat_interleave(k, 0))
        lp = G.sequence_log_probs(decoder, *rows, sequences)
        lp.sum().backward()
        values.append(lp.detach())
        grads.append(source.grad)
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_a_memory_that_does_not_divide_the_rows_is_refused(setup):
    decoder, memory, memory_mask = setup
    ids = torch.full((4, 1), BOS_ID)
    with pytest.raises(ValueError, match="memory has 3 rows"):
        decoder(ids, torch.ones_like(ids), memory, memory_mask)
