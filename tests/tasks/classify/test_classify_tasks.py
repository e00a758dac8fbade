"""SNLI-VE and NLVR2 end to end on synthetic scenes: `mplug finetune snli-ve|nlvr2` then `mplug eval`, through the
CLI. SNLI-VE must learn: held-out accuracy well above the 33% of chance; every metric is recomputed from the
predictions file; the model folder keeps its classifier."""
from __future__ import annotations

import json
import os

import pytest
import torch

from mplug_pretrain.data.writers.classification import write_synthetic_nlvr2, write_synthetic_snli_ve
from mplug_pretrain.data.writers.shard_writer import shard_pattern
from mplug_pretrain.models.mplug import MPLUG
from tests.helpers import REPO_ROOT, call_mplug, read_log, run_mplug

CONFIG = os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml")
# No dropout and lr 3e-4: the image-dependent labels (entailment vs contradiction) then reach 62.5 / 64.5 / 64.5 %
# for run.seed 42 / 1 / 2 (2026-11-26). With dropout 0.1 and lr 1e-3 they ranged 50-69 over six seeds and
# random streams, and one seed collapsed both onto one label: the test passed or failed by the draw.
COMMON = ["data.train_shards=null", "model.vision.image_size=32", "data.num_workers=1",
          "model.text.dropout=0.0", "model.decoder.dropout=0.0",
          "optim.warmup_steps=10", "optim.lr_rest=3e-4", "optim.lr_vision=3e-4", "run.tensorboard=false",
          "run.log_every=10", "eval.batch_size=100"]
SNLI_VE_STEPS = 300  # 32 px, batch 32: overall 75-76 % held-out (neutral 100: the text alone tells it)


def _shards(root: str, write, name: str, num: int, seed: int) -> str:
    entry = write(root, num=num, seed=seed, name=name, max_samples=400)
    return shard_pattern(root, name, len(entry["shards"]))


@pytest.fixture(scope="module")
def runs(module_mktemp) -> dict:
    root = module_mktemp("classification")
    shards = str(root / "shards")
    snli = {"train": _shards(shards, write_synthetic_snli_ve, "snli_train", 1200, 0),
            "val": _shards(shards, write_synthetic_snli_ve, "snli_val", 300, 1)}
    nlvr = {"train": _shards(shards, write_synthetic_nlvr2, "nlvr_train", 64, 0),
            "val": _shards(shards, write_synthetic_nlvr2, "nlvr_val", 40, 1)}
    out = {}
    for task, section, data, steps, batch in (("snli-ve", "snli_ve", snli, SNLI_VE_STEPS, 32),
                                              ("nlvr2", "nlvr2", nlvr, 4, 16)):
        trained = run_mplug(["finetune", task, "--config", CONFIG, f"{section}.train_shards={data['train']}",
                             f"{section}.val_shards={data['val']}", f"optim.max_steps={steps}",
                             f"run.checkpoint_every_steps={steps}",
                             f"run.output_dir={root}", f"run.name={section}", *COMMON, f"data.batch_size={batch}",
                             *(["run.eval_every_steps=2"] if task == "nlvr2" else [])],
                            timeout=1200)
        assert trained.returncode == 0, trained.stderr[-3000:]
        evaluated = call_mplug(["eval", task, "--config", CONFIG, "--checkpoint", str(root / section / "model"),
                                "--out", str(root / f"{section}_eval" / "metrics.json"),
                                f"{section}.val_shards={data['val']}", *COMMON])
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        out[task] = {"run_dir": root / section, "eval_dir": root / f"{section}_eval", "steps": steps}
    return out


def _load(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.slow  # runs
def test_nlvr2_validation_while_fine_tuning_equals_the_final_evaluation_at_the_last_step(runs):
    run = runs["nlvr2"]
    records = [r for r in read_log(run["run_dir"]) if "val_accuracy" in r]
    assert [r["step"] for r in records] == [2, 4] and all(r["val_num_examples"] == 40 for r in records)
    assert records[-1]["val_accuracy"] == pytest.approx(_load(run["run_dir"] / "metrics.json")["accuracy"])
    best = max(records, key=lambda r: r["val_accuracy"])
    assert _load(run["run_dir"] / "best" / "val_metrics.json")["step"] == best["step"]


def _recomputed(predictions: list[dict]) -> float:
    return 100.0 * sum(p["label"] == p["prediction"] for p in predictions) / len(predictions)


@pytest.mark.slow  # two fine-tuning runs in subprocesses (DeepSpeed), ~3 min on 2 quiet cores
@pytest.mark.parametrize("task, examples, labels", [("snli-ve", 300, 3), ("nlvr2", 40, 2)])
def test_finetune_then_eval_write_consistent_metrics(runs, task, examples, labels):
    run = runs[task]
    assert [r["step"] for r in read_log(run["run_dir"])][-1] == run["steps"]
    final, evaluated = _load(run["run_dir"] / "metrics.json"), _load(run["eval_dir"] / "metrics.json")
    for metrics in (final, evaluated):
        predictions = _load(metrics["predictions"])
        assert len(predictions) == examples == metrics["num_examples"]
        assert metrics["accuracy"] == pytest.approx(_recomputed(predictions))
    assert evaluated["accuracy"] == final["accuracy"]  # the same folder and shards: the same predictions
    model = MPLUG.from_pretrained(str(run["run_dir"] / "model"))
    assert model.config.heads.classifier_classes == labels and model.classifier is not None
    images = model.config.heads.classifier_images
    logits = model.classify(torch.zeros(1, images, 3, 32, 32), torch.tensor([[101, 102]]), torch.ones(1, 2).long())
    assert logits.shape == (1, labels)


@pytest.mark.slow
def test_snli_ve_learns_beyond_chance(runs):
    metrics = _load(runs["snli-ve"]["eval_dir"] / "metrics.json")
    assert metrics["majority_baseline"] == pytest.approx(100 / 3)  # labels cycle: chance is a third
    assert metrics["accuracy"] >= 55.0, metrics  # chance 33.3
    # the image-dependent labels (a true vs a false colour / position) must beat their own 50% too
    per_label = metrics["per_label_accuracy"]
    assert (per_label["entailment"] + per_label["contradiction"]) / 2 >= 55.0, metrics
