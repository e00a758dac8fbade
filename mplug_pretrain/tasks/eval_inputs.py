"""What each ``mplug eval <task>`` needs before it loads anything: its inputs in the config and a model folder
that can answer it. ``mplug submit eval`` checks every (task, checkpoint) here, so a bad pair fails on the
login node instead of as one array task on the cluster. The tasks raise the same messages when run directly.
"""
from __future__ import annotations

import os

from mplug_pretrain.errors import ConfigError


def _shards_or_annotations(what: str, root: str, files: str):
    """eval.shards, or eval.annotations with its files under eval.<root>."""
    def check(cfg) -> str | None:
        e = cfg.eval
        if (e.shards is None) == (e.annotations is None):
            return f"eval.shards / eval.annotations: set exactly one (the {what} to evaluate)"
        if e.annotations is not None and getattr(e, root) is None:
            return f"eval.{root}: needed with eval.annotations ({files})"
        return None
    return check


_image_text_set = _shards_or_annotations("image-text set", "image_root", "where the image paths start")
_videos = _shards_or_annotations("videos", "video_root", "the folder of the video files")


def _caption(cfg) -> str | None:
    if not (cfg.eval.shards or cfg.caption.val_shards):
        return ("eval.shards / caption.val_shards: one is required (image-layout caption shards with "
                "json.captions references, e.g. `mplug make-shards coco --split test --layout image`)")
    return None


def _vqa(cfg) -> str | None:
    if not cfg.vqa.val_shards:
        return "vqa.val_shards: the questions to answer are required by `mplug eval vqa`"
    return None


def _classification(section: str, task: str):
    def check(cfg) -> str | None:
        if not getattr(cfg, section).val_shards:
            return f"{section}.val_shards: the examples to classify are required by `mplug eval {task}`"
        return None
    return check


def _grounding(cfg) -> str | None:
    if not cfg.grounding.val_shards:
        return "grounding.val_shards: the examples to locate are required by `mplug eval grounding`"
    return None


CONFIG_CHECKS = {
    "caption": _caption,
    "vqa": _vqa,
    "retrieval": _image_text_set,
    "snli-ve": _classification("snli_ve", "snli-ve"),
    "nlvr2": _classification("nlvr2", "nlvr2"),
    "grounding": _grounding,
    "video-retrieval": _videos,
    "video-qa": _videos,
    "video-caption": _videos,
}


def require_inputs(task: str, cfg) -> None:
    """Raises ConfigError when the config lacks an input ``mplug eval task`` reads."""
    problem = CONFIG_CHECKS[task](cfg)
    if problem:
        raise ConfigError(problem)


def check_eval_inputs(task: str, cfg, checkpoint: str) -> None:
    """Raises ConfigError naming the field or the folder when ``mplug eval task --checkpoint checkpoint`` would
    fail before evaluating: an input missing from the config, a folder that is no model folder (config.json and
    model.safetensors), or a classification task asked of a model without its classifier."""
    from mplug_pretrain.data.writers.classification import TASK_LABELS
    from mplug_pretrain.models.folder.config_io import CONFIG_FILE, read_model_config
    from mplug_pretrain.models.folder.locate import model_folder_problem
    from mplug_pretrain.models.mplug import WEIGHTS_FILE
    try:
        require_inputs(task, cfg)
    except ConfigError as err:
        raise ConfigError(f"{task}: {err}") from None
    problem = model_folder_problem(checkpoint)
    if problem:
        raise ConfigError(f"--checkpoint {checkpoint}: {problem}")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(checkpoint, name)):
            raise ConfigError(f"--checkpoint {checkpoint}: not a model folder (no {name}); pass a save_pretrained "
                              "or `mplug export` folder (e.g. a run's model/)")
    model = read_model_config(os.path.join(checkpoint, CONFIG_FILE))
    if task in TASK_LABELS and model.heads.classifier_classes != len(TASK_LABELS[task]):
        raise ConfigError(f"{task}: --checkpoint {checkpoint}: no {task} classifier ({len(TASK_LABELS[task])} "
                          f"classes); evaluate a model fine-tuned by `mplug finetune {task}`")
