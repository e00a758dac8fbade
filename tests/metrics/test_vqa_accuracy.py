"""VQA accuracy: the leave-one-out formula by brute force, and the official normalisation variants."""
import json

import pytest

from mplug_pretrain.metrics.vqa_accuracy import (
    evaluate_vqa,
    normalize_answer,
    process_punctuation,
    vqa_accuracy,
    write_vqa_submission,
)


def brute_force(pred: str, answers: list[str]) -> float:
    """mean over the 10 subsets of 9 humans of min(#humans in the subset who said pred / 3, 1)."""
    accs = []
    for left_out in range(len(answers)):
        subset = answers[:left_out] + answers[left_out + 1:]
        accs.append(min(sum(a == pred for a in subset) / 3, 1.0))
    return sum(accs) / len(accs)


def test_authors_worked_example():
    answers = ["yes"] * 8 + ["no"] * 2
    for variant in ("official_2021", "legacy"):
        assert vqa_accuracy("yes", answers, variant) == pytest.approx(1.0)
        assert vqa_accuracy("no", answers, variant) == pytest.approx(0.6)
    assert brute_force("yes", answers) == pytest.approx(1.0)
    assert brute_force("no", answers) == pytest.approx(0.6)


@pytest.mark.parametrize("counts", [(1, 9), (2, 8), (3, 7), (4, 6), (0, 10), (10, 0)])
def test_formula_matches_brute_force(counts):
    hit, other = counts
    answers = ["red"] * hit + ["blue"] * other
    for pred in ("red", "blue", "green"):
        assert vqa_accuracy(pred, answers) == pytest.approx(brute_force(pred, answers))


def test_punctuation_rules_by_hand():
    assert process_punctuation("yes!") == "yes "          # a mark not next to a space becomes a space
    assert process_punctuation("hello , world") == "hello  world"  # next to a space: deleted
    assert process_punctuation("1,000") == "1000"         # digit,digit anywhere: all marks deleted
    assert process_punctuation("3.5") == "3.5"            # a period before a digit stays
    assert process_punctuation("end.") == "end"
    assert normalize_answer("Two") == "2"
    assert normalize_answer("The dog") == "dog"
    assert normalize_answer("an apple") == "apple"
    assert normalize_answer("dont") == "don't"
    assert normalize_answer("none") == "0"
    assert normalize_answer("Yes!") == "yes"


# each case: prediction, 10 GT answers (they disagree), and the normalised forms written by hand
NORMALISATION_CASES = [
    ("Two", ["2"] * 6 + ["two"] * 2 + ["3"] * 2, "2", ["2"] * 8 + ["3"] * 2),
    ("a dog", ["dog"] * 2 + ["the dog"] * 2 + ["cat"] * 6, "dog", ["dog"] * 4 + ["cat"] * 6),
    ("yes!", ["yes"] * 2 + ["no"] * 8, "yes", ["yes"] * 2 + ["no"] * 8),
    ("dont", ["don't"] * 3 + ["no"] * 7, "don't", ["don't"] * 3 + ["no"] * 7),
    ("1,000", ["1000"] * 2 + ["100"] * 8, "1000", ["1000"] * 2 + ["100"] * 8),
]


@pytest.mark.parametrize("pred,answers,pred_norm,answers_norm", NORMALISATION_CASES)
def test_official_2021_normalises_both_sides(pred, answers, pred_norm, answers_norm):
    assert vqa_accuracy(pred, answers, "official_2021") == pytest.approx(brute_force(pred_norm, answers_norm))


def test_official_2021_compares_exactly_when_humans_agree():
    answers = ["yes"] * 10
    assert vqa_accuracy("Yes", answers, "official_2021") == 0.0
    assert vqa_accuracy(" yes\n", answers, "official_2021") == 1.0  # whitespace is still stripped
    assert vqa_accuracy("Yes", answers, "legacy") == 1.0             # legacy always normalises the prediction


def test_legacy_only_punctuation_normalises_gt():
    # GT "the dog" keeps its article in legacy; the prediction loses it
    answers = ["the dog"] * 4 + ["dog"] * 2 + ["cat"] * 4
    assert vqa_accuracy("the dog", answers, "legacy") == pytest.approx(brute_force("dog", answers))
    assert vqa_accuracy("the dog", answers, "official_2021") == pytest.approx(
        brute_force("dog", ["dog"] * 6 + ["cat"] * 4))
    # numbers: "two" in GT stays a word in legacy, the prediction becomes "2"
    answers = ["two"] * 5 + ["2"] * 2 + ["3"] * 3
    assert vqa_accuracy("two", answers, "legacy") == pytest.approx(brute_force("2", answers))
    assert vqa_accuracy("two", answers, "official_2021") == pytest.approx(1.0)


def test_evaluate_and_submission(tmp_path):
    gts = {1: ["yes"] * 8 + ["no"] * 2, 2: ["2"] * 10, 3: ["red"] * 2 + ["blue"] * 8}
    preds = {1: "no", 2: "2", 3: "red"}
    result = evaluate_vqa(preds, gts, answer_types={1: "yes/no", 2: "number", 3: "other"})
    expected = [brute_force("no", gts[1]), 1.0, brute_force("red", gts[3])]
    assert result["overall"] == pytest.approx(100 * sum(expected) / 3)
    assert result["per_answer_type"]["number"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="not answered"):
        evaluate_vqa({1: "no"}, gts)
    path = tmp_path / "vqa_test_dev.json"
    write_vqa_submission({20: "yes", 10: "2"}, str(path))
    assert json.loads(path.read_text()) == [{"question_id": 10, "answer": "2"}, {"question_id": 20, "answer": "yes"}]
    with pytest.raises(TypeError, match="question_id"):
        write_vqa_submission({"10": "2"}, str(path))
