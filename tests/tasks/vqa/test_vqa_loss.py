"""The VQA answer loss against an independent per-question, per-answer computation."""
from __future__ import annotations

import math

import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim before timm / open_clip)
from mplug_pretrain.config import config_from_dict
from mplug_pretrain.data.tokenizer import load_tokenizer, tokenize
from mplug_pretrain.errors import ConfigError, DataError
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.tasks.finetuning import freeze_parts, freeze_pretraining_heads
from mplug_pretrain.tasks.vqa.finetune import vqa_answer_loss

QUESTIONS = ["what color is the shape?", "is there a red circle in the image?", "", "how many dogs?"]
ANSWERS = [["blue", "teal"], ["yes", "no", "not sure"], [], ["two"]]
WEIGHTS = [[0.7, 0.3], [0.5, 0.3, 0.2], [], [1.0]]
IS_PAD = [False, False, True, False]
MAX_ANSWER_LENGTH = 5


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def make_batch(tokenizer) -> dict:
    ids, mask = tokenize(tokenizer, QUESTIONS, 20)
    return {"image": torch.randn(len(QUESTIONS), 3, 64, 64, generator=torch.Generator().manual_seed(3)),
            "question_input_ids": ids, "question_attention_mask": mask, "answers": ANSWERS,
            "answer_weights": WEIGHTS, "question_id": [10, 11, -1, 13], "is_pad": torch.tensor(IS_PAD)}


def reference_loss(model, batch, tokenizer) -> float:
    """(1/#real questions) sum_q sum_a w * -log p(a), each question alone (no padding), each token's
    log-probability read from its own prefix run."""
    total, questions = 0.0, 0
    for q, (answers, weights) in enumerate(zip(batch["answers"], batch["answer_weights"])):
        if bool(batch["is_pad"][q]):
            continue
        questions += 1
        length = int(batch["question_attention_mask"][q].sum())
        memory, memory_mask = model.memory(batch["image"][q:q + 1], batch["question_input_ids"][q:q + 1, :length],
                                           batch["question_attention_mask"][q:q + 1, :length])
        for answer, weight in zip(answers, weights):
            tokens = tokenizer(answer, truncation=True, max_length=MAX_ANSWER_LENGTH + 1)["input_ids"]
            nll = 0.0
            for t in range(1, len(tokens)):
                prefix = torch.tensor([tokens[:t]])
                logits = model.decoder(prefix, torch.ones_like(prefix), memory, memory_mask).logits[0, -1].double()
                nll -= float(logits[tokens[t]] - torch.logsumexp(logits, 0))
            total += weight * nll
    return total / questions


@pytest.mark.parametrize("decoder_type", ["bert", "expansion", "acf"])
def test_loss_is_the_weighted_answer_nll_per_question(decoder_type, tokenizer):
    torch.manual_seed(0)
    model = freeze_pretraining_heads(build_model("tiny", decoder={"type": decoder_type, "layers": 1},
                                                 heads={"use_momentum": False})).eval()
    batch = make_batch(tokenizer)
    loss = vqa_answer_loss(model, batch, tokenizer, MAX_ANSWER_LENGTH)
    with torch.no_grad():
        expected = reference_loss(model, batch, tokenizer)
    assert math.isclose(float(loss.detach()), expected, rel_tol=1e-4), (float(loss.detach()), expected)
    loss.backward()
    assert any(p.grad is not None for p in model.image_encoder.parameters())
    assert all(p.grad is None for p in model.itm_head.parameters()), "pretraining heads must stay frozen"


def test_longer_answers_are_truncated_with_their_sep_kept(tokenizer):
    torch.manual_seed(0)
    model = build_model("tiny", heads={"use_momentum": False}).eval()
    batch = make_batch(tokenizer)
    batch["answers"] = [["a very long answer that goes on and on"], ["yes"], [], ["two"]]
    batch["answer_weights"] = [[1.0], [1.0], [], [1.0]]
    with torch.no_grad():
        assert math.isclose(float(vqa_answer_loss(model, batch, tokenizer, MAX_ANSWER_LENGTH)),
                            reference_loss(model, batch, tokenizer), rel_tol=1e-4)


def test_padding_only_batch_gives_a_differentiable_zero(tokenizer):
    model = build_model("tiny", heads={"use_momentum": False})
    batch = make_batch(tokenizer)
    batch["is_pad"] = torch.ones(len(QUESTIONS), dtype=torch.bool)
    loss = vqa_answer_loss(model, batch, tokenizer, MAX_ANSWER_LENGTH)
    assert float(loss.detach()) == 0.0 and loss.requires_grad


def test_a_real_question_without_answers_is_a_data_error(tokenizer):
    model = build_model("tiny", heads={"use_momentum": False})
    batch = make_batch(tokenizer)
    batch["is_pad"] = torch.zeros(len(QUESTIONS), dtype=torch.bool)
    with pytest.raises(DataError, match="question -1"):
        vqa_answer_loss(model, batch, tokenizer, MAX_ANSWER_LENGTH)


def test_frozen_parts_get_no_gradient_and_no_dropout(tokenizer):
    model = freeze_parts(build_model("tiny", heads={"use_momentum": False}).train(),
                         ["image_encoder", "text_encoder", "fusion"])
    assert not model.fusion.training and model.decoder.training
    batch = make_batch(tokenizer)
    loss = vqa_answer_loss(model, batch, tokenizer, MAX_ANSWER_LENGTH)
    loss.backward()
    assert all(p.grad is None for part in (model.image_encoder, model.text_encoder, model.fusion)
               for p in part.parameters())
    assert all(p.grad is not None for p in model.decoder.layers.parameters())
    batch["is_pad"] = torch.ones(len(QUESTIONS), dtype=torch.bool)
    assert vqa_answer_loss(model, batch, tokenizer, MAX_ANSWER_LENGTH).requires_grad  # DeepSpeed can step it


def test_config_names_the_bad_vqa_field():
    with pytest.raises(ConfigError, match="vqa.freeze: unknown part 'decoder'"):
        config_from_dict({"vqa": {"freeze": ["decoder"]}}, check_paths=False)
    with pytest.raises(ConfigError, match="vqa.generation.max_length"):
        config_from_dict({"vqa": {"generation": {"max_length": 1}}}, check_paths=False)
