"""Answer-list ranking against brute force: every candidate scored by an independent loop that runs the
decoder on one growing prefix at a time (no batching, no padding, no cache)."""
from __future__ import annotations

import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim before timm / open_clip)
from mplug_pretrain.data.tokenizer import load_tokenizer, tokenize
from mplug_pretrain.models.generation.answer_ranking import rank_answers
from mplug_pretrain.models.presets import build_model

# several lengths; distinct first word pieces, so the first-token filter keeps a well-defined set
ANSWERS = ["yes", "no", "fire hydrant", "blue", "two people", "skateboarding", "red and white", "10",
           "teal", "umbrella", "on the left side"]
TOLERANCE = 1e-4  # batched teacher forcing vs one-prefix-at-a-time, fp32


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def tiny(decoder_type: str):
    torch.manual_seed({"bert": 0, "expansion": 1, "acf": 2}[decoder_type])
    model = build_model("tiny", decoder={"type": decoder_type, "layers": 1, "dropout": 0.0},
                        fusion={"layers": 1}, text={"encoder_layers": 1, "dropout": 0.0},
                        heads={"use_momentum": False}).eval()
    # a trained decoder has sharp, well separated distributions; random init gives near-uniform ones
    with torch.no_grad():
        for p in model.decoder.parameters():
            p.mul_(6.0)
    return model


def memory_for(model, tokenizer, batch: int = 3):
    g = torch.Generator().manual_seed(7)
    image = torch.randn(batch, 3, 64, 64, generator=g)
    ids, mask = tokenize(tokenizer, ["what color is the shape?", "is there a dog?", "how many?"][:batch], 16)
    with torch.no_grad():
        return model.memory(image, ids, mask)


def brute_force_log_prob(decoder, memory_row, memory_mask_row, answer: list[int]) -> float:
    """log p(answer[1:] | [CLS], memory) = sum_t log p(w_t | w_<t): one decoder call per prefix."""
    total = 0.0
    with torch.no_grad():
        for t in range(1, len(answer)):
            prefix = torch.tensor([answer[:t]])
            logits = decoder(prefix, torch.ones_like(prefix), memory_row, memory_mask_row).logits[0, -1]
            total += float(logits.double().log_softmax(-1)[answer[t]])
    return total


def answer_token_lists(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[: int(m.sum())].tolist() for row, m in zip(ids, mask)]


@pytest.mark.parametrize("decoder_type", ["bert", "expansion", "acf"])
def test_ranking_returns_the_highest_sequence_log_prob(decoder_type, tokenizer):
    model = tiny(decoder_type)
    memory, memory_mask = memory_for(model, tokenizer)
    ids, mask = tokenize(tokenizer, ANSWERS, 8)
    tokens = answer_token_lists(ids, mask)
    ranked = rank_answers(model, memory, memory_mask, ids, mask, k=len(ANSWERS))
    assert ranked.shape == (memory.shape[0], len(ANSWERS))
    for b in range(memory.shape[0]):
        scores = torch.tensor([brute_force_log_prob(model.decoder, memory[b:b + 1], memory_mask[b:b + 1], t)
                               for t in tokens], dtype=torch.float64)
        assert sorted(ranked[b].tolist()) == list(range(len(ANSWERS)))
        assert scores[ranked[b, 0]] >= scores.max() - TOLERANCE
        ordered = scores[ranked[b]]
        assert bool((ordered[:-1] >= ordered[1:] - TOLERANCE).all()), "not sorted by sequence log-prob"
        assert scores.max() - scores.min() > 0.1  # the candidates are really told apart


@pytest.mark.parametrize("k", [1, 4])
def test_first_token_filter_then_full_scoring(k, tokenizer):
    model = tiny("bert")
    memory, memory_mask = memory_for(model, tokenizer)
    ids, mask = tokenize(tokenizer, ANSWERS, 8)
    tokens = answer_token_lists(ids, mask)
    assert len({t[1] for t in tokens}) == len(tokens)
    ranked = rank_answers(model, memory, memory_mask, ids, mask, k=k)
    assert ranked.shape == (memory.shape[0], k)
    for b in range(memory.shape[0]):
        first = torch.tensor([brute_force_log_prob(model.decoder, memory[b:b + 1], memory_mask[b:b + 1], t[:2])
                              for t in tokens])
        kept = first.topk(k).indices.tolist()
        assert set(ranked[b].tolist()) == set(kept)
        full = {c: brute_force_log_prob(model.decoder, memory[b:b + 1], memory_mask[b:b + 1], tokens[c])
                for c in kept}
        assert full[int(ranked[b, 0])] >= max(full.values()) - TOLERANCE


def test_ranking_is_independent_of_batch_composition(tokenizer):
    model = tiny("bert")
    memory, memory_mask = memory_for(model, tokenizer)
    ids, mask = tokenize(tokenizer, ANSWERS, 8)
    together = rank_answers(model, memory, memory_mask, ids, mask, k=5)
    alone = torch.cat([rank_answers(model, memory[b:b + 1], memory_mask[b:b + 1], ids, mask, k=5)
                       for b in range(memory.shape[0])])
    assert torch.equal(together, alone)


def test_bad_candidates_are_refused(tokenizer):
    model = tiny("bert")
    memory, memory_mask = memory_for(model, tokenizer, batch=1)
    ids, mask = tokenize(tokenizer, ["yes", "no"], 8)
    no_cls = ids.clone()
    no_cls[:, 0] = 1996
    with pytest.raises(ValueError, match="start with"):
        rank_answers(model, memory, memory_mask, no_cls, mask, k=2)
    with pytest.raises(ValueError, match="k"):
        rank_answers(model, memory, memory_mask, ids, mask, k=0)
    with pytest.raises(ValueError, match="same shape"):
        rank_answers(model, memory, memory_mask, ids, mask[:1], k=2)
    empty_ids, empty_mask = tokenize(tokenizer, ["yes", ""], 8)
    with pytest.raises(ValueError, match="empty"):
        rank_answers(model, memory, memory_mask, empty_ids, empty_mask, k=2)
