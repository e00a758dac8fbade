"""The ``decoder_api`` contract, checked on every decoder head ``decoder_factory.build_decoder`` makes (bert |
expansion | acf with each formula), as timm tests its whole zoo: shapes, causality, incremental decoding with
the cache equal to full recomputation, beam reordering of the cache, padding, autocast, gradients, greedy /
beam / sampled generation through the shared search, the save / load round trip and input errors.
What is specific to one head (transformers parity, parameter counts, clustering) stays in its own file."""
from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import load_file

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.factory import build_decoder, build_visual_refiner
from mplug_pretrain.models.generation import decoding as G
from mplug_pretrain.models.heads.prefix_lm import prefix_lm_loss
from mplug_pretrain.models.model_config import DecoderConfig, VisualRefinerConfig
from mplug_pretrain.models.weights.reader import load_weights_into, save_weights, tied_aliases

VOCAB, WIDTH = 110, 16
ZOO = {  # id -> DecoderConfig fields beyond the common small sizes
    "bert": {"type": "bert"},
    "expansion": {"type": "expansion", "expansion_slots": 3},
    "acf-paper": {"type": "acf", "acf_formula": "paper"},
    "acf-official": {"type": "acf", "acf_formula": "official"},
}
zoo = pytest.mark.parametrize("kind", list(ZOO))


def make_decoder(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    fields = {"layers": 2, "heads": 2, "ffn_dim": 32, "dropout": 0.1, "max_positions": 24, **ZOO[kind], **overrides}
    return build_decoder(DecoderConfig(**fields), vocab_size=VOCAB, width=WIDTH).eval()


def real(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The logits of real tokens [N, V]: at padding positions the contract promises nothing (padding masks keys
    only; a padding query of the bert head attends uniformly to whatever keys there are)."""
    return logits[mask[:, -logits.shape[1]:].bool()]


@pytest.fixture(scope="module")
def batch():
    """ids [3, 8] (row 1 left padded by 2), mask [3, 8], memory [3, 5, WIDTH], memory_mask [3, 5]."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, :2] = 0
    memory = torch.randn(3, 5, WIDTH, generator=g)
    memory_mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    return ids, mask, memory, memory_mask


@zoo
def test_the_factory_builds_the_configured_head(kind):
    from mplug_pretrain.models.decoders.acf.decoder import ACFDecoder
    from mplug_pretrain.models.decoders.bert import BertDecoder
    from mplug_pretrain.models.decoders.expansionnet.decoder import ExpansionDecoder
    classes = {"bert": BertDecoder, "expansion": ExpansionDecoder, "acf": ACFDecoder}
    assert type(make_decoder(kind)) is classes[ZOO[kind]["type"]]


def test_the_factory_names_an_unknown_type():
    with pytest.raises(ConfigError, match="model.decoder.type"):
        build_decoder(DecoderConfig(type="lstm"), vocab_size=10, width=8)
    assert build_visual_refiner(VisualRefinerConfig(), width=8, grid_size=2) is None
    with pytest.raises(ConfigError, match="model.refiner.type"):
        build_visual_refiner(VisualRefinerConfig(type="pool"), width=8, grid_size=2)


@zoo
def test_forward_gives_logits_per_token_and_a_finite_loss(kind, batch):
    ids, mask, memory, memory_mask = batch
    decoder = make_decoder(kind)
    out = decoder(ids, mask, memory, memory_mask)
    assert out.logits.shape == (3, 8, VOCAB) and out.past is None
    loss = prefix_lm_loss(out.logits, ids, mask)
    assert loss.ndim == 0 and torch.isfinite(loss) and loss > 0
    assert decoder(ids, mask, memory, memory_mask, use_cache=True).past is not None


@zoo
def test_changing_a_future_token_never_changes_earlier_logits(kind, batch):
    ids, mask, memory, memory_mask = batch
    decoder = make_decoder(kind)
    with torch.no_grad():
        logits = decoder(ids, mask, memory, memory_mask).logits
        for t in (1, 4, 7):
            changed = ids.clone()
            changed[:, t] = (changed[:, t] + 7) % VOCAB
            other = decoder(changed, mask, memory, memory_mask).logits
            torch.testing.assert_close(real(other[:, :t], mask[:, :t]), real(logits[:, :t], mask[:, :t]),
                                       rtol=0, atol=0)
            assert not torch.allclose(other[:, t], logits[:, t])


@zoo
def test_incremental_decoding_with_the_cache_equals_full_recomputation(kind, batch):
    """A 3-token prompt, a chunk of 2, then one token at a time."""
    ids, mask, memory, memory_mask = batch
    decoder = make_decoder(kind)
    with torch.no_grad():
        full = decoder(ids, mask, memory, memory_mask).logits
        out = decoder(ids[:, :3], mask[:, :3], memory, memory_mask, use_cache=True)
        parts, past = [out.logits], out.past
        for start, end in [(3, 5), *((t, t + 1) for t in range(5, 8))]:
            out = decoder(ids[:, start:end], mask[:, :end], memory, memory_mask, past=past, use_cache=True)
            parts.append(out.logits)
            past = out.past
    torch.testing.assert_close(real(torch.cat(parts, 1), mask), real(full, mask), rtol=0, atol=1e-5)


@zoo
@pytest.mark.parametrize("packed", [False, True])
def test_a_vocabulary_slice_gives_those_logits_and_their_gradients(kind, packed, batch):
    """vocab=slice(a, b): the full logits' columns a..b-1, with and without the cache, inside packed decoding too;
    the loss on them sends the same gradients to every parameter (the tied embedding included)."""
    from mplug_pretrain.models.generation.packed_decoding import packed_for_decoding
    ids, mask, memory, memory_mask = batch
    decoder, vocab = make_decoder(kind), slice(40, 73)
    with torch.no_grad(), packed_for_decoding(decoder) if packed else contextlib.nullcontext(decoder) as fast:
        full = fast(ids, mask, memory, memory_mask).logits
        part = fast(ids, mask, memory, memory_mask, vocab=vocab).logits
        first = fast(ids[:, :5], mask[:, :5], memory, memory_mask, use_cache=True, vocab=vocab)
        last = fast(ids[:, 5:], mask, memory, memory_mask, past=first.past, use_cache=True, vocab=vocab).logits
    assert part.shape == (3, 8, 33)
    torch.testing.assert_close(real(part, mask), real(full[..., vocab], mask), rtol=0, atol=1e-5)
    torch.testing.assert_close(real(torch.cat([first.logits, last], 1), mask), real(part, mask), rtol=0, atol=1e-5)
    if packed:
        return
    grads = []
    for sliced in (False, True):
        decoder.zero_grad()
        out = decoder(ids, mask, memory, memory_mask, vocab=vocab if sliced else None).logits
        logits = out if sliced else out[..., vocab]
        torch.nn.functional.cross_entropy(real(logits, mask), real(ids, mask) % 33).backward()
        grads.append({n: p.grad.clone() for n, p in decoder.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@zoo
def test_reorder_cache_selects_and_repeats_rows(kind, batch):
    ids, mask, memory, memory_mask = batch
    decoder = make_decoder(kind)
    index = torch.tensor([2, 2, 0, 1])
    with torch.no_grad():
        full = decoder(ids[index], mask[index], memory[index], memory_mask[index]).logits
        past = decoder(ids[:, :5], mask[:, :5], memory, memory_mask, use_cache=True).past
        step = decoder(ids[index, 5:], mask[index], memory[index], memory_mask[index],
                       past=decoder.reorder_cache(past, index)).logits
    torch.testing.assert_close(real(step, mask[index]), real(full[:, 5:], mask[index]), rtol=0, atol=1e-5)


@zoo
def test_padding_does_not_change_real_positions(kind, batch):
    ids, mask, memory, memory_mask = batch
    decoder = make_decoder(kind)
    with torch.no_grad():
        logits = decoder(ids, mask, memory, memory_mask).logits
        other_ids, other_memory = ids.clone(), memory.clone()
        other_ids[1, :2] = torch.tensor([5, 9])  # left-padding token contents
        other_memory[1, 3:] = 10 * torch.randn(2, WIDTH)  # masked memory slots
        other = decoder(other_ids, mask, other_memory, memory_mask).logits
        # right padding: the real prefix equals the unpadded run
        right = decoder(ids[:1], torch.tensor([[1] * 5 + [0] * 3]), memory[:1], memory_mask[:1]).logits
        unpadded = decoder(ids[:1, :5], mask[:1, :5], memory[:1], memory_mask[:1]).logits
    torch.testing.assert_close(other[1, 2:], logits[1, 2:], rtol=0, atol=1e-5)
    assert torch.isfinite(other).all()  # padding queries too: no empty softmax row
    torch.testing.assert_close(right[:, :5], unpadded, rtol=0, atol=1e-5)


@zoo
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_position_is_finite_under_autocast(kind, batch, dtype):
    """The first causal position (a softmax over a single key) is where half precision overflowed."""
    ids, mask, memory, memory_mask = batch
    decoder = make_decoder(kind)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        first = decoder(ids[:, :1], mask[:, :1], memory, memory_mask, use_cache=True)
        second = decoder(ids[:, 1:2], mask[:, :2], memory, memory_mask, past=first.past)
        full = decoder(ids, mask, memory, memory_mask)
    for logits in (first.logits, second.logits, full.logits):
        assert torch.isfinite(logits.float()).all()


@zoo
def test_backward_reaches_every_trainable_parameter(kind, batch):
    ids, mask, memory, memory_mask = batch
    decoder = make_decoder(kind).train()
    prefix_lm_loss(decoder(ids, mask, memory, memory_mask).logits, ids, mask).backward()
    missing = [n for n, p in decoder.named_parameters()
               if p.requires_grad and (p.grad is None or not torch.isfinite(p.grad).all() or not p.grad.abs().sum() > 0)]
    assert not missing


@zoo
def test_greedy_beam_and_sampling_through_the_shared_search(kind, batch):
    _, _, memory, memory_mask = batch
    decoder = make_decoder(kind)
    greedy = G.greedy_search(decoder, memory, memory_mask, max_length=6)
    beam = G.beam_search(decoder, memory, memory_mask, beam_size=3, max_length=6, num_return=2)
    assert greedy.shape[0] == 3 and greedy.shape[1] <= 6
    assert beam.sequences.shape[:2] == (3, 2) and beam.sequences.shape[2] <= 6 and beam.scores.shape == (3, 2)
    assert bool((beam.scores[:, 0] >= beam.scores[:, 1]).all())
    assert torch.equal(G.beam_search(decoder, memory, memory_mask, beam_size=1, max_length=6).sequences[:, 0], greedy)
    seqs, lp = G.sample(decoder, memory, memory_mask, num_samples=2, max_length=6,
                        generator=torch.Generator().manual_seed(0))
    assert seqs.shape[0] == 6 and lp.shape == (6,)
    with torch.no_grad():
        teacher_forced = G.sequence_log_probs(decoder, memory.repeat_interleave(2, 0),
                                              memory_mask.repeat_interleave(2, 0), seqs)
    torch.testing.assert_close(teacher_forced, lp, rtol=0, atol=1e-4)


@zoo
@pytest.mark.parametrize("tie", [True, False])
def test_save_and_load_round_trip(kind, tie, batch, tmp_path):
    """save_weights / load_weights_into (the model folder's safetensors path) into a differently seeded head:
    the same logits; a tied output projection is one [V, D] matrix in the file and in the loaded head."""
    ids, mask, memory, memory_mask = batch
    decoder = make_decoder(kind, tie_word_embeddings=tie)
    path = str(tmp_path / "decoder.safetensors")
    save_weights(decoder, path)
    loaded = make_decoder(kind, seed=1, tie_word_embeddings=tie)
    load_weights_into(loaded, load_file(path), path)
    stored = load_file(path)
    assert set(stored) == set(decoder.state_dict()) - set(tied_aliases(decoder))
    vocab_matrices = 1 if tie else 2  # token embedding (+ an untied output projection)
    assert sum(t.shape == (VOCAB, WIDTH) for t in stored.values()) == vocab_matrices
    assert sum(p.shape == (VOCAB, WIDTH) for p in loaded.parameters()) == vocab_matrices
    with torch.no_grad():
        assert torch.equal(loaded(ids, mask, memory, memory_mask).logits, decoder(ids, mask, memory, memory_mask).logits)


@zoo
def test_bad_inputs_name_the_argument(kind, batch):
    ids, mask, memory, memory_mask = batch
    decoder = make_decoder(kind)
    with pytest.raises(ValueError, match="attention_mask.*T_past"):
        decoder(ids, mask[:, :5], memory, memory_mask)
    with pytest.raises(ValueError, match="max_positions"):
        decoder(torch.ones(1, 30, dtype=torch.long), torch.ones(1, 30), memory[:1], memory_mask[:1])
