"""mplug_pretrain: mPLUG-style vision-language pretraining and fine-tuning.

Library use (no training code is imported)::

    import mplug_pretrain
    model, train_transform, eval_transform, tokenizer = mplug_pretrain.create_model_and_transforms("tiny")

Attributes are imported lazily, so ``import mplug_pretrain`` stays light.
"""
import os
import sys

if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
    # OpenMP's default waiting (spin ~300k turns, then sleep) makes torch's CPU threads spin against any other
    # busy process: on a shared 2-core machine one competing process made a 2-thread tiny training step 17x
    # slower. Sleeping at once costs a wake-up per operation instead (decoding ~30 % slower on a quiet
    # machine); spinning 10k turns first keeps back-to-back operations awake and still yields under
    # competition (docs/configuration.md, "CPU threads"). Read once, when torch loads; a user's setting wins.
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from mplug_pretrain.compat import ensure_torchvision_importable

ensure_torchvision_importable()

__version__ = "0.1.0"

_LAZY = {
    "create_model_and_transforms": ("mplug_pretrain.factory", "create_model_and_transforms"),
    "MPLUG": ("mplug_pretrain.models.mplug", "MPLUG"),
    "Preprocessing": ("mplug_pretrain.models.folder.preprocessing", "Preprocessing"),
    "GenerationSettings": ("mplug_pretrain.models.generation.settings", "GenerationSettings"),
    "AnswerSettings": ("mplug_pretrain.models.generation.settings", "AnswerSettings"),
    "load_tokenizer": ("mplug_pretrain.data.tokenizer", "load_tokenizer"),
}
__all__ = [
    "MPLUG",
    "AnswerSettings",
    "GenerationSettings",
    "Preprocessing",
    "__version__",
    "create_model_and_transforms",
    "load_tokenizer",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mplug_pretrain' has no attribute {name!r}")
    import importlib
    module_name, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module_name), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
