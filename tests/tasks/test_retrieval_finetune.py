"""`mplug finetune retrieval` on the embedded scenes: ITC + ITM only (no MLM / PrefixLM computed or logged), the
loss weights kept in the fine-tuned folder, and the final model evaluated like `mplug eval retrieval` (the same
recalls from the same folder and shards)."""
from __future__ import annotations

import json
import os

import pytest

from tests.helpers import REPO_ROOT, call_mplug, read_log, run_mplug

CONFIG = os.path.join(REPO_ROOT, "configs", "demo.yaml")


@pytest.fixture(scope="module")
def finetuned(demo_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval_ft")
    val = demo_shards["pretrain_val"]
    common = ["data.train_shards=null", "model.vision.image_size=32", "eval.batch_size=64", "eval.k_test=8",
              "eval.num_workers=0"]
    trained = run_mplug(["finetune", "retrieval", "--config", CONFIG, "init_from=null",
                         f"retrieval.train_shards={demo_shards['pretrain_train'].split('{')[0]}000000.tar",
                         f"retrieval.val_shards={val}", "optim.max_steps=6", "optim.warmup_steps=1",
                         "data.batch_size=12", "run.log_every=1", "run.tensorboard=false", "model.heads.queue_size=48",
                         f"run.output_dir={root}", "run.name=ft", *common], timeout=900)
    assert trained.returncode == 0, trained.stderr[-3000:]
    evaluated = call_mplug(["eval", "retrieval", "--config", CONFIG, "--checkpoint", str(root / "ft" / "model"),
                            "--out", str(root / "eval.json"), f"eval.shards={val}", *common])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    return root


@pytest.mark.slow  # a DeepSpeed fine-tuning run in a subprocess
def test_only_itc_and_itm_train_and_the_folder_keeps_their_weights(finetuned):
    log = read_log(finetuned / "ft")
    assert [r["step"] for r in log] == list(range(1, 7))
    assert all(r["loss_itc"] > 0 and r["loss_itm"] > 0 and "loss_mlm" not in r for r in log)
    assert all(r["loss"] == pytest.approx(r["loss_itc"] + r["loss_itm"], rel=1e-4) for r in log)
    with open(finetuned / "ft" / "model" / "config.json") as f:
        weights = json.load(f)["heads"]["loss_weights"]
    assert weights == {"itc": 1.0, "itm": 1.0, "mlm": 0.0, "prefixlm": 0.0}


@pytest.mark.slow
def test_final_evaluation_equals_mplug_eval_retrieval(finetuned):
    with open(finetuned / "ft" / "metrics.json") as f:
        final = json.load(f)
    with open(finetuned / "eval.json") as f:
        evaluated = json.load(f)
    assert final["num_images"] == evaluated["num_images"] == 250
    for key in ("txt_r1", "txt_r5", "img_r1", "img_r10"):
        assert final[key] == pytest.approx(evaluated[key]), key
