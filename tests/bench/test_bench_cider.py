"""The CIDEr bench in quick mode: writes its JSON and our scores equal pycocoevalcap's."""
import json

import numpy as np
import pytest

from mplug_pretrain.bench.cider import run, synthetic_captions
from mplug_pretrain.metrics.cider_d import CiderD


def test_quick_bench_writes_rows_and_its_figures_follow_from_the_raw_timings(tmp_path):
    result = run(str(tmp_path), quick=True)
    written = json.loads((tmp_path / "cider.json").read_text())
    assert written["bench"] == "cider" and written["rows"] == result["rows"]
    rows = {(r["implementation"], r["df"]): r for r in result["rows"]}
    assert result["hypotheses"] == 200 * 5
    for df in ("batch", "training refs"):
        ours, pyco = rows[("mplug_pretrain CiderD", df)], rows[("pycocoevalcap CiderScorer", df)]
        assert ours["seconds"] > 0 and pyco["seconds"] > 0
        assert ours["speedup_vs_pycocoevalcap"] == pytest.approx(pyco["seconds"] / ours["seconds"])
        for row in (ours, pyco):
            assert row["hypotheses_per_second"] == pytest.approx(result["hypotheses"] / row["seconds"])


def test_the_scores_the_bench_times_equal_pycocoevalcap_computed_here():
    """The agreement the bench reports (max_abs_diff), established independently: CiderD with batch document
    frequencies against pycocoevalcap's CiderScorer on the bench's own synthetic captions."""
    from pycocoevalcap.cider.cider_scorer import CiderScorer

    refs, hyps = synthetic_captions(40, 5, 2)
    image_index = np.repeat(np.arange(40), 2)
    ours = CiderD(refs).score(hyps, image_index, df="corpus")
    scorer = CiderScorer(n=4, sigma=6.0)
    for hyp, i in zip(hyps, image_index):
        scorer += (hyp, refs[i])
    theirs = np.asarray(scorer.compute_score()[1])
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-9)
    assert theirs.std() > 0  # the captions differ, so equal scores are not a coincidence of constants


def test_synthetic_captions_are_seeded_and_8_to_15_words():
    refs, samples = synthetic_captions(20, 5, 5, seed=3)
    assert (refs, samples) == synthetic_captions(20, 5, 5, seed=3)
    lengths = [len(c.split()) for c in samples + [r for rs in refs for r in rs]]
    assert min(lengths) >= 8 and max(lengths) <= 15
