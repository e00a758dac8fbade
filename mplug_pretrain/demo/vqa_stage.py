"""`mplug demo`'s VQA stage: fine-tune the pretrained tiny model on easy-vqa's train shards
(configs/vqa_demo.yaml) and compare its accuracy on the easy-vqa test subset with the majority baseline.

    vqa_accuracy           official VQA accuracy (%) of the fine-tuned model on shards['vqa_val']
    vqa_majority_baseline  the same accuracy (%) of always answering the most frequent TRAINING answer
                           (counted over every annotator answer in shards['vqa_train'])
    vqa_inference          "generate" | "rank", as the config chose
    vqa_model_dir          the fine-tuned model folder
The ground truth for the baseline is read straight from the shards' JSON (not from the model's run).
"""
from __future__ import annotations

import json
import os
import tarfile
from collections import Counter

import yaml

from mplug_pretrain.config import config_from_dict
from mplug_pretrain.config_loader import deep_merge
from mplug_pretrain.data.reading.urls import all_shards, expand_sources
from mplug_pretrain.errors import DataError
from mplug_pretrain.metrics.vqa_accuracy import evaluate_vqa
from mplug_pretrain.utils.resources import config_file

DEMO_CONFIG = config_file("vqa_demo.yaml")
QUICK_STEPS = 40  # `mplug demo --quick`


def read_vqa_answers(urls: str) -> dict:
    """question_id -> the human answers, from the ``.json`` members of VQA shards (images are not read)."""
    answers = {}
    for url in all_shards(expand_sources(urls)):
        with tarfile.open(url) as tar:
            for member in tar:
                if not member.name.endswith(".json"):
                    continue
                meta = json.load(tar.extractfile(member))
                raw = [str(a.get("answer", "") if isinstance(a, dict) else a).strip() for a in meta.get("answers", [])]
                answers[meta.get("question_id", member.name)] = raw
    if not answers:
        raise DataError(f"{urls}: no VQA questions found")
    return answers


def majority_baseline(train_urls: str, val_urls: str, normalization: str) -> tuple[str, float]:
    """(the most frequent training answer, its accuracy % on the questions of ``val_urls`` that have answers)."""
    counts = Counter(a for answers in read_vqa_answers(train_urls).values() for a in answers)
    if not counts:
        raise DataError(f"{train_urls}: the training questions have no answers")
    majority = counts.most_common(1)[0][0]
    gts = {q: a for q, a in read_vqa_answers(val_urls).items() if a}
    return majority, evaluate_vqa({q: majority for q in gts}, gts, normalization)["overall"]


def vqa_demo(pretrained_dir: str, shards: dict, run_root: str, quick: bool = False, seed: int = 0) -> dict:
    """Fine-tune ``pretrained_dir`` (a save_pretrained folder) on shards['vqa_train'] (``QUICK_STEPS`` steps if
    ``quick``), evaluate on shards['vqa_val'] (run folder ``run_root``/vqa) -> the demo's VQA numbers."""
    from mplug_pretrain.tasks.vqa.finetune import run
    with open(DEMO_CONFIG) as f:
        raw = yaml.safe_load(f)
    # data.train_shards is not read by VQA, but the generic validation checks that its files exist
    if quick:
        raw = deep_merge(raw, {"optim": {"max_steps": QUICK_STEPS}})
    raw = deep_merge(raw, {"init_from": pretrained_dir, "run": {"output_dir": run_root, "seed": seed, "overwrite": True},
                           "data": {"train_shards": shards["vqa_train"], "tokenizer": shards["tokenizer"]},
                           "vqa": {"train_shards": shards["vqa_train"], "val_shards": shards["vqa_val"],
                                   "answer_list": shards.get("vqa_answer_list")}})
    cfg = config_from_dict(raw)
    result = run(cfg)
    metrics = result["metrics"]
    majority, baseline = majority_baseline(shards["vqa_train"], shards["vqa_val"], cfg.vqa.normalization)
    return {"vqa_accuracy": metrics["vqa_accuracy"], "vqa_majority_baseline": baseline,
            "vqa_majority_answer": majority, "vqa_inference": cfg.vqa.inference,
            "vqa_model_dir": os.path.join(cfg.run_dir, "model")}
