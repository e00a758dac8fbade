"""The grounding loss (tasks/grounding/finetune.py) recomputed by hand from the decoder's coordinate logits: token
cross-entropy, re-weighted as the official mPLUG code does by min(L1, 5) of each coordinate and (1 - GIoU) of the
teacher-forced argmax box (GIoU from torchvision), fillers left out."""
from __future__ import annotations

import math

import pytest
import torch

from mplug_pretrain.config import config_from_dict
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.tasks.grounding import evaluate as grounding_task
from mplug_pretrain.tasks.grounding.finetune import grounding_loss
from mplug_pretrain.tasks.grounding.model import CoordinateTokens, teacher_forced_logits


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = build_model("tiny", **{"vision.image_size": 32}).eval()
    tokens = CoordinateTokens.from_tokenizer(load_tokenizer(), 32)
    batch = {"images": torch.randn(3, 3, 32, 32), "input_ids": torch.tensor([[101, 1996, 2417, 102]] * 3),
             "attention_mask": torch.ones(3, 4, dtype=torch.long),
             "boxes": torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.05, 0.2, 0.2], [0.0, 0.0, 1.0, 1.0]]),
             "is_pad": torch.tensor([False, False, True])}
    return model, tokens, batch


def _by_hand(model, tokens, batch, weighted: bool) -> float:
    from torchvision.ops import generalized_box_iou  # after mplug_pretrain: its shim lets torchvision import
    with torch.no_grad():
        logits = teacher_forced_logits(model, batch["images"], batch["input_ids"], batch["attention_mask"],
                                       batch["boxes"], tokens).double()
    total, rows = 0.0, 0
    for b in range(2):  # the third row is a filler
        box = batch["boxes"][b].double()
        bins = [math.floor(float(c) * 32) for c in box]
        predicted = torch.tensor([float(logits[b, t].argmax()) / 32 for t in range(4)], dtype=torch.float64)
        xyxy = lambda v: torch.stack([v[0], v[1], v[0] + v[2], v[1] + v[3]])[None]
        giou = float(generalized_box_iou(xyxy(predicted), xyxy(box))[0, 0])
        row = 0.0
        for t in range(4):
            ce = float(torch.logsumexp(logits[b, t], 0) - logits[b, t, bins[t]])
            weight = min(abs(float(predicted[t] - box[t])), 5.0) * (1 - giou) if weighted else 1.0
            row += ce * weight / 4
        total, rows = total + row, rows + 1
    return total / rows


@pytest.mark.parametrize("weighting", ["l1_giou", "none"])
def test_loss_equals_the_hand_computation(case, weighting):
    model, tokens, batch = case
    with torch.no_grad():
        loss = grounding_loss(model, batch, tokens, weighting)
    assert float(loss) == pytest.approx(_by_hand(model, tokens, batch, weighting == "l1_giou"), rel=1e-5)


def test_a_batch_of_fillers_gives_zero_and_gradients_reach_the_decoder(case):
    model, tokens, batch = case
    fillers = {**batch, "is_pad": torch.ones(3, dtype=torch.bool)}
    assert float(grounding_loss(model, fillers, tokens)) == 0.0
    model.zero_grad()
    grounding_loss(model, batch, tokens, "none").backward()
    assert model.decoder.parameters().__next__().grad is not None


def test_eval_refuses_a_resolution_other_than_the_coordinate_bins(case, tmp_path):
    model, _, _ = case
    model.save_pretrained(str(tmp_path / "model"))
    cfg = config_from_dict({"eval": {"image_size": 64}, "grounding": {"val_shards": "unused-{000000..000001}.tar"}})
    with pytest.raises(ConfigError, match="32 coordinate bins"):
        grounding_task.run(cfg, str(tmp_path / "model"), out=str(tmp_path / "metrics.json"))
