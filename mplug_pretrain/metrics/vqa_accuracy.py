"""VQA v2 accuracy, the official formula and answer normalisation (GT-Vision-Lab/VQA ``vqaEval.py``).

For a question with human answers a_1..a_m (m = 10 in VQA v2) and a predicted answer p:

    acc(p) = 1/m * sum_i min(1, #{j != i : a_j == p} / 3)

i.e. min(#humans that said p / 3, 1) averaged over the m leave-one-out subsets of m-1 humans
(the authors' explanation: https://github.com/GT-Vision-Lab/VQA/issues/1). With 8 x "yes" and
2 x "no": acc("yes") = 1.0, acc("no") = 0.6.

Answer normalisation, selectable by name:
- ``"official_2021"`` (default): the evaluator after commit a013f00 (2021-03-11, "Fixed
  processing answers bug"). Prediction and GT answers lose newlines/tabs and outer spaces; then,
  only when the GT answers disagree, *both* go through punctuation and digit/article/contraction
  normalisation. When all GT answers agree the comparison is exact (case-sensitive).
- ``"legacy"``: the earlier evaluator vendored by mPLUG (``vqaTools/vqaEval.py``) and LAVIS
  (``lavis/common/vqa_tools/vqa_eval.py``): the prediction is always fully normalised; GT
  answers get punctuation normalisation only, and only when they disagree.

The tables and regular expressions below are the official ones, including their quirks: the
period regex's ``(?!<=\\d)`` is a negative lookahead (not a lookbehind) and ``re.UNICODE`` is
passed as the ``count`` of ``sub`` (so at most 32 periods are removed); ``manualMap`` maps
"none" to "0".
"""
from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Literal

from mplug_pretrain.utils.atomic_files import write_json_atomic

Normalization = Literal["official_2021", "legacy"]

CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't", "dont": "don't",
    "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't", "havent": "haven't",
    "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd", "howll": "how'll",
    "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm", "Ive": "I've", "isnt": "isn't", "itd": "it'd",
    "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll", "let's": "let's", "maam": "ma'am", "mightnt": "mightn't",
    "mightnt've": "mightn't've", "mightn'tve": "mightn't've", "mightve": "might've", "mustnt": "mustn't",
    "mustve": "must've", "neednt": "needn't", "notve": "not've", "oclock": "o'clock", "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at", "shant": "shan't", "shed've": "she'd've",
    "she'dve": "she'd've", "she's": "she's", "shouldve": "should've", "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've", "somebodyll": "somebody'll",
    "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've", "someone'dve": "someone'd've",
    "someonell": "someone'll", "someones": "someone's", "somethingd": "something'd",
    "somethingd've": "something'd've", "something'dve": "something'd've", "somethingll": "something'll",
    "thats": "that's", "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've",
    "therere": "there're", "theres": "there's", "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've",
    "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't",
    "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll",
    "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've", "who'dve": "who'd've",
    "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're", "whys": "why's",
    "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll",
    "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd",
    "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}
MANUAL_MAP = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
              "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
ARTICLES = ("a", "an", "the")
PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
COMMA_STRIP = re.compile(r"(\d)(\,)(\d)")
PUNCTUATION = (";", r"/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!")


def process_punctuation(text: str) -> str:
    """Official ``processPunctuation``: a mark next to a space (or any text with a digit,digit
    comma) is deleted, otherwise replaced by a space; periods not followed by a digit go."""
    out = text
    for p in PUNCTUATION:
        if (p + " " in text or " " + p in text) or COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return PERIOD_STRIP.sub("", out, int(re.UNICODE))  # the official call passes the flag as count


def process_digit_article(text: str) -> str:
    """Official ``processDigitArticle``: lower-case, number words -> digits, drop articles,
    restore missing apostrophes of contractions."""
    words = [MANUAL_MAP.get(w, w) for w in text.lower().split()]
    words = [w for w in words if w not in ARTICLES]
    return " ".join(CONTRACTIONS.get(w, w) for w in words)


def normalize_answer(text: str) -> str:
    return process_digit_article(process_punctuation(text))


def _strip_whitespace(text: str) -> str:
    return text.replace("\n", " ").replace("\t", " ").strip()


def vqa_accuracy(prediction: str, gt_answers: Sequence[str], normalization: Normalization = "official_2021") -> float:
    """Accuracy in [0, 1] of one predicted answer against the human answers of one question."""
    if isinstance(gt_answers, str) or len(gt_answers) == 0:
        raise ValueError("gt_answers: expected a non-empty list of answer strings")
    if normalization == "official_2021":
        pred = _strip_whitespace(prediction)
        gts = [_strip_whitespace(a) for a in gt_answers]
        if len(set(gts)) > 1:
            gts = [normalize_answer(a) for a in gts]
            pred = normalize_answer(pred)
    elif normalization == "legacy":
        pred = normalize_answer(_strip_whitespace(prediction))
        gts = list(gt_answers)
        if len(set(gts)) > 1:
            gts = [process_punctuation(a) for a in gts]
    else:
        raise ValueError(f"normalization: expected 'official_2021' or 'legacy', got {normalization!r}")
    matches = sum(a == pred for a in gts)
    # leaving out human i removes one match exactly when a_i == pred
    return sum(min(1.0, (matches - (a == pred)) / 3.0) for a in gts) / len(gts)


def evaluate_vqa(predictions: Mapping[Hashable, str], gt_answers: Mapping[Hashable, Sequence[str]],
                 normalization: Normalization = "official_2021",
                 answer_types: Mapping[Hashable, str] | None = None, require_all: bool = True) -> dict:
    """{"overall": %, "per_answer_type": {type: %}, "num_questions": N, "normalization": name}.

    Percentages are unrounded (the official script rounds to 2 decimals). ``require_all``: every
    question in ``gt_answers`` must be predicted.
    """
    if not predictions:
        raise ValueError("predictions: empty")
    unknown = [q for q in predictions if q not in gt_answers]
    if unknown:
        raise ValueError(f"predictions: {len(unknown)} question ids have no ground truth, e.g. {unknown[0]!r}")
    if require_all:
        missing = [q for q in gt_answers if q not in predictions]
        if missing:
            raise ValueError(f"predictions: {len(missing)} questions are not answered, e.g. {missing[0]!r}")
    per_question = {q: vqa_accuracy(p, gt_answers[q], normalization) for q, p in predictions.items()}
    result = {"overall": 100.0 * sum(per_question.values()) / len(per_question),
              "num_questions": len(per_question), "normalization": normalization}
    if answer_types is not None:
        by_type: dict[str, list[float]] = {}
        for q, acc in per_question.items():
            if q not in answer_types:
                raise ValueError(f"answer_types: no answer type for question {q!r}")
            by_type.setdefault(answer_types[q], []).append(acc)
        result["per_answer_type"] = {t: 100.0 * sum(v) / len(v) for t, v in sorted(by_type.items())}
    return result


def write_vqa_submission(predictions: Mapping[int, str] | Sequence[Mapping[str, object]], path: str) -> list[dict]:
    """Write the EvalAI/test-dev results file ``[{"question_id": int, "answer": str}]``.

    The VQA server expects every question of the test2015 questions file (test-dev is a subset
    it selects itself).
    """
    items = predictions.items() if isinstance(predictions, Mapping) else [
        (p["question_id"], p["answer"]) for p in predictions]
    rows, seen = [], set()
    for qid, answer in items:
        if isinstance(qid, bool) or not isinstance(qid, int):
            raise TypeError(f"question_id: must be an int, got {qid!r}")
        if qid in seen:
            raise ValueError(f"question_id: {qid} appears twice")
        if not isinstance(answer, str):
            raise TypeError(f"answer for question {qid}: must be a str, got {type(answer).__name__}")
        seen.add(qid)
        rows.append({"question_id": qid, "answer": answer})
    rows.sort(key=lambda r: r["question_id"])
    write_json_atomic(path, rows, indent=None)
    return rows
