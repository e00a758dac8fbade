"""Files shipped inside the package: the run configs (``configs/*.yaml``) and the DeepSpeed ZeRO templates
(``deepspeed_configs/*.json``). In the repository ``mplug_pretrain/configs`` and ``mplug_pretrain/deepspeed_configs``
are links to the top-level folders users read; a built wheel (``pip install .``) holds copies (package data)."""
from __future__ import annotations

import os

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mplug_pretrain/


def _shipped(folder: str, name: str) -> str:
    path = os.path.join(PACKAGE_DIR, folder, name)
    if not os.path.isfile(path):
        known = sorted(os.listdir(os.path.join(PACKAGE_DIR, folder))) if os.path.isdir(
            os.path.join(PACKAGE_DIR, folder)) else []
        raise FileNotFoundError(f"{path}: not shipped with mplug_pretrain (shipped {folder}/: {', '.join(known)})")
    return path


def config_file(name: str) -> str:
    """A shipped run config, e.g. ``config_file("demo.yaml")`` -> its path."""
    return _shipped("configs", name)


def deepspeed_template(name: str) -> str:
    """A shipped ZeRO template, e.g. ``deepspeed_template("zero2.json")`` -> its path."""
    return _shipped("deepspeed_configs", name)
