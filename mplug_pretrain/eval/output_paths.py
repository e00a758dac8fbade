"""Where an evaluation's side files go: beside its metrics JSON and named after it, so two evaluations
writing ``a.json`` and ``b.json`` into one folder never overwrite each other's predictions."""
from __future__ import annotations

import os


def beside_metrics(metrics_path: str, name: str) -> str:
    """``runs/x/eval/val.json`` + ``vqa_submission.json`` -> ``runs/x/eval/val.vqa_submission.json``."""
    path = os.path.abspath(metrics_path)
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(os.path.dirname(path), f"{stem}.{name}")
