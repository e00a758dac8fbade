"""Coordinate tokens of grounding (tasks/grounding/model.py): the official mPLUG ids ([unused339] prefix, [unused340 +
bin] coordinates), the floor-to-bin round trip, greedy decoding restricted to coordinate tokens."""
from __future__ import annotations

import pytest
import torch

from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.tasks.grounding.model import CoordinateTokens, predict_boxes, teacher_forced_logits


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_reserved_token_ids_are_the_official_ones(tokenizer):
    tokens = CoordinateTokens.from_tokenizer(tokenizer, 336)
    # bert-base-uncased: [unused0] = 1, [unused1..98] = 2..99, [unused99..] = 104.. (ids 100-103: [UNK] [CLS] [SEP]
    # [MASK]), so [unusedN] = N + 5 for N >= 99
    assert tokens.prefix_id == 339 + 5 and tokens.first_id == 340 + 5 and tokens.ids == slice(345, 345 + 337)
    assert tokenizer.convert_ids_to_tokens([tokens.prefix_id, tokens.first_id, tokens.first_id + 336]) == \
        ["[unused339]", "[unused340]", "[unused676]"]
    with pytest.raises(ConfigError, match="image size <= 653"):
        CoordinateTokens.from_tokenizer(tokenizer, 700)


def test_round_trip_is_exact_on_bins_and_floors_between_them(tokenizer):
    tokens = CoordinateTokens.from_tokenizer(tokenizer, 32)
    on_bins = torch.arange(33).float().div(32).repeat(4, 1).t()  # every bin value 0/32 .. 32/32, [33, 4]
    ids = tokens.encode(on_bins)
    assert ids.tolist() == [[tokens.first_id + i] * 4 for i in range(33)]
    torch.testing.assert_close(tokens.decode(ids), on_bins)
    between = torch.tensor([[0.0999, 0.5, 1.7, -0.2]])  # floor(3.197) = 3, 16, clamped to 32 and 0
    assert (tokens.encode(between) - tokens.first_id).tolist() == [[3, 16, 32, 0]]
    assert bool(((tokens.decode(tokens.encode(between)) - between.clamp(0, 1)).abs() < 1 / 32).all())


def test_greedy_decoding_emits_only_coordinate_tokens_and_follows_the_teacher_forced_argmax(tokenizer):
    torch.manual_seed(0)
    model = build_model("tiny", **{"vision.image_size": 32}).eval()
    tokens = CoordinateTokens.from_tokenizer(tokenizer, 32)
    images, ids, mask = torch.randn(3, 3, 32, 32), torch.tensor([[101, 2417, 102]] * 3), torch.ones(3, 3).long()
    boxes = predict_boxes(model, images, ids, mask, tokens)
    assert boxes.shape == (3, 4) and bool(((boxes * 32).round() == boxes * 32).all())
    assert bool((boxes >= 0).all()) and bool((boxes <= 1).all())
    # teacher forcing with the decoded box gives, at every position, the argmax that decoding chose
    logits = teacher_forced_logits(model, images, ids, mask, boxes, tokens)
    assert logits.shape == (3, 4, 33)
    assert torch.equal(logits.argmax(-1), (boxes * 32).round().long())
