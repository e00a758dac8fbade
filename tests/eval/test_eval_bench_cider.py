"""The CIDEr bench in quick mode: writes its JSON and our scores equal pycocoevalcap's."""
import json

from mplug_pretrain.bench.cider import run, synthetic_captions


def test_quick_bench_writes_rows_and_agrees(tmp_path):
    result = run(str(tmp_path), quick=True)
    written = json.loads((tmp_path / "cider.json").read_text())
    assert written["bench"] == "cider" and written["rows"] == result["rows"]
    rows = {(r["implementation"], r["df"]): r for r in result["rows"]}
    for df in ("batch", "training refs"):
        ours = rows[("mplug_pretrain CiderD", df)]
        assert ours["max_abs_diff"] < 1e-9
        assert rows[("pycocoevalcap CiderScorer", df)]["seconds"] > 0
    assert result["hypotheses"] == 200 * 5


def test_synthetic_captions_are_seeded_and_8_to_15_words():
    refs, samples = synthetic_captions(20, 5, 5, seed=3)
    assert (refs, samples) == synthetic_captions(20, 5, 5, seed=3)
    lengths = [len(c.split()) for c in samples + [r for rs in refs for r in rs]]
    assert min(lengths) >= 8 and max(lengths) <= 15
