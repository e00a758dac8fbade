"""What a path given as a model folder (``--checkpoint``) is, when it is not one, and which folder to pass instead:
a run folder's ``model/``, the last stage's ``model/`` of a multi-stage caption run (``2_scst/model``), or
``mplug export`` for a run that has checkpoints but no model yet."""
from __future__ import annotations

import os
import re

CONFIG_FILE = "config.json"


def _stage_models(run_dir: str) -> list[str]:
    """``N_name/model`` folders of a multi-stage run, in stage order."""
    stages = [d for d in os.listdir(run_dir) if re.fullmatch(r"\d+_\w+", d)
              and os.path.isfile(os.path.join(run_dir, d, "model", CONFIG_FILE))]
    return [os.path.join(run_dir, d, "model") for d in sorted(stages, key=lambda d: int(d.split("_")[0]))]


def model_folder_problem(path: str) -> str | None:
    """None when ``path`` is a model folder (holds config.json); else "not a model folder (why); pass ..."."""
    if os.path.isfile(os.path.join(path, CONFIG_FILE)):
        return None
    if not os.path.exists(path):
        return "not a model folder (no such folder)"
    if not os.path.isdir(path):
        return "not a model folder (a file)"
    if os.path.isfile(os.path.join(path, "model", CONFIG_FILE)):
        return f"a run folder, not a model folder; pass {os.path.join(path, 'model')}"
    stages = _stage_models(path)
    if stages:
        return (f"a multi-stage run folder, not a model folder; pass its last stage's model {stages[-1]}"
                + (f" (earlier: {', '.join(stages[:-1])})" if len(stages) > 1 else ""))
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return (f"a run folder without a model/ (unfinished?); make one with `mplug export --checkpoint {path} "
                "--out DIR`")
    return ("not a model folder (no config.json); pass a save_pretrained or `mplug export` folder (e.g. a run's "
            "model/)")
