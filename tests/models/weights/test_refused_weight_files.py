"""Issue 37, item 5: a weights file that would need arbitrary unpickling, given as a pretrained tower (our ViT,
timm, open_clip) or a BERT folder, ends `mplug pretrain` in one `mplug:` line naming the setting, the file and the
object (exit 3), before any training; the payload never runs."""
from __future__ import annotations

import json

import pytest

import mplug_pretrain  # noqa: F401  (torchvision shim before timm / open_clip)
from tests.helpers import call_mplug, tiny_pretrain_args
from tests.train.test_train_safe_loading import plant

TIMM = ["model.vision.backbone=timm:vit_tiny_patch16_224", "model.vision.backbone_kwargs={depth: 1}"]
OPEN_CLIP = ["model.vision.backbone=open_clip:ViT-B-16",
             "model.vision.backbone_kwargs={width: 64, layers: 1, patch_size: 16, head_width: 32}"]


def _bert_folder(path, marker) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 256, "num_attention_heads": 4,
                                                  "intermediate_size": 1024, "vocab_size": 30522}))
    plant(path / "pytorch_model.bin", marker)
    return str(path)


@pytest.mark.parametrize("tower", ["clip_vit", "timm", "open_clip", "bert"])
def test_a_refused_pickle_is_one_mplug_line(tower, tmp_path, demo_shards):
    marker = tmp_path / "ran"
    if tower == "bert":
        extra = [f"model.text.bert_checkpoint={_bert_folder(tmp_path / 'bert', marker)}"]
        field, path = "model.text.bert_checkpoint", tmp_path / "bert" / "pytorch_model.bin"
    else:
        path = tmp_path / "weights.pt"
        plant(path, marker)
        extra = [f"model.vision.checkpoint_path={path}", *{"timm": TIMM, "open_clip": OPEN_CLIP}.get(tower, [])]
        field = "model.vision.checkpoint_path"
    proc = call_mplug(["pretrain", *tiny_pretrain_args(tmp_path, demo_shards, "run", 1, extra, vocab="bert")])
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mplug:")]
    assert lines == [proc.stderr.strip().splitlines()[-1]] and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"mplug: data error: {field}: {path}: refused: loading it would create ")
    assert "Traceback" not in proc.stderr and not marker.exists()
