"""`mplug bench vision-tower --quick`: our ViT vs timm's ViT of the same size (JSON form, sane times, equal sizes)."""
import json
import math

import pytest

from mplug_pretrain.bench.vision_tower import run


def test_quick_rows(tmp_path):
    pytest.importorskip("timm")
    out = tmp_path / "vision_tower.json"
    run(str(out), quick=True)
    result = json.loads(out.read_text())
    assert result["bench"] == "vision_tower" and result["timm_model"] == "vit_base_patch16_224"
    assert [r["mode"] for r in result["rows"]] == ["train fwd+bwd", "forward (no grad)"]
    # the same size: the parameter counts differ only by timm's qkv bias layout (within 2%)
    assert result["timm_parameters"] == pytest.approx(result["ours_parameters"], rel=0.02)
    for row in result["rows"]:
        for key in ("ours_seconds", "timm_seconds"):
            assert math.isfinite(row[key]) and 0 < row[key] < 60
        assert row["ratio"] == pytest.approx(row["timm_seconds"] / row["ours_seconds"])
