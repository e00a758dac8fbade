"""Caption metrics wrapper against pycocoevalcap called directly (tokenizer + each scorer)."""
import json
import logging

import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

from mplug_pretrain.metrics.captions import (
    evaluate_captions,
    predictions_as_dict,
    spice_jars_present,
    write_caption_results,
)

REFERENCES = {
    101: ["A man riding a wave on top of a surfboard.", "A surfer rides a large wave, in the ocean!",
          "A person on a surf-board riding a wave.", "Man surfing on a big blue wave."],
    202: ["Two giraffes standing next to each other in a field.", "A pair of giraffes in a grassy enclosure.",
          "Two tall giraffes near some trees."],
    303: ["A plate of food with broccoli and rice.", "A white plate topped with meat and vegetables.",
          "A meal of chicken, broccoli, and rice on a plate.", "A close up of a plate of food.",
          "A dinner plate with broccoli rice and meat."],
}
PREDICTIONS = [{"image_id": 101, "caption": "A man riding a wave on a surfboard."},
               {"image_id": 202, "caption": "two giraffes standing in a field"},
               {"image_id": 303, "caption": "A plate of food with meat, rice & broccoli."}]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def ours():
    handler = _Records()
    logger = logging.getLogger("mplug_pretrain.metrics.captions")
    logger.addHandler(handler)
    try:
        scores = evaluate_captions(PREDICTIONS, REFERENCES)
    finally:
        logger.removeHandler(handler)
    return scores, handler.records


@pytest.fixture(scope="module")
def direct():
    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": c} for c in caps] for i, caps in REFERENCES.items()})
    res = tokenizer.tokenize({p["image_id"]: [{"caption": p["caption"]}] for p in PREDICTIONS})
    out = {}
    bleu, _ = Bleu(4).compute_score(gts, res)
    out.update({f"Bleu_{k + 1}": b for k, b in enumerate(bleu)})
    out["METEOR"] = Meteor().compute_score(gts, res)[0]
    out["ROUGE_L"] = Rouge().compute_score(gts, res)[0]
    out["CIDEr"] = Cider().compute_score(gts, res)[0]
    return out


def test_scores_equal_direct_pycocoevalcap(ours, direct):
    scores, _ = ours
    for name, value in direct.items():
        assert scores[name] == pytest.approx(value, abs=1e-12), name
    assert 0 < scores["CIDEr"] and 0 < scores["METEOR"] < 1


def test_spice_skipped_with_one_log_line_when_jars_absent(ours):
    scores, records = ours
    if spice_jars_present():
        assert "SPICE" in scores
    else:
        assert "SPICE" not in scores
        spice_lines = [r for r in records if "SPICE" in r.getMessage()]
        assert len(spice_lines) == 1 and "jars" in spice_lines[0].getMessage()


def test_spice_on_without_jars_fails_fast():
    if spice_jars_present():
        pytest.skip("the SPICE jars are installed here")
    with pytest.raises(RuntimeError, match="SPICE requested"):
        evaluate_captions(PREDICTIONS, REFERENCES, spice="on")


def test_results_file_is_coco_format(tmp_path):
    path = tmp_path / "captions_results.json"
    write_caption_results(PREDICTIONS, str(path))
    rows = json.loads(path.read_text())
    assert rows == sorted(PREDICTIONS, key=lambda p: str(p["image_id"]))
    assert predictions_as_dict(rows) == {p["image_id"]: p["caption"] for p in PREDICTIONS}


def test_bad_predictions_are_named():
    with pytest.raises(ValueError, match="appears twice"):
        predictions_as_dict(PREDICTIONS + [PREDICTIONS[0]])
    with pytest.raises(ValueError, match="no prediction"):
        evaluate_captions(PREDICTIONS[:2], REFERENCES)
    with pytest.raises(ValueError, match="no reference"):
        evaluate_captions(PREDICTIONS + [{"image_id": 999, "caption": "a cat"}], REFERENCES)
