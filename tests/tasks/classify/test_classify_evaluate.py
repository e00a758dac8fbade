"""SNLI-VE / NLVR2 accuracy, per-label accuracy and majority baseline against scikit-learn's metrics."""
from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, recall_score

from mplug_pretrain.tasks.classify.evaluate import score

LABELS = ("entailment", "neutral", "contradiction")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_score_equals_sklearn(seed):
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, 3, size=57)
    predicted = np.where(rng.random(57) < 0.6, gold, rng.integers(0, 3, size=57))
    records = [{"label": int(g), "prediction": int(p)} for g, p in zip(gold, predicted)]
    metrics = score(records, LABELS)
    assert metrics["accuracy"] == pytest.approx(100 * accuracy_score(gold, predicted))
    per_label = recall_score(gold, predicted, labels=[0, 1, 2], average=None, zero_division=0)
    assert [metrics["per_label_accuracy"][k] for k in LABELS] == pytest.approx(list(100 * per_label))
    assert metrics["majority_baseline"] == pytest.approx(100 * np.bincount(gold).max() / len(gold))
    assert metrics["num_examples"] == 57


def test_a_label_without_examples_has_no_per_label_accuracy():
    metrics = score([{"label": 0, "prediction": 0}, {"label": 0, "prediction": 2}], LABELS)
    assert metrics["accuracy"] == 50.0 and set(metrics["per_label_accuracy"]) == {"entailment"}
