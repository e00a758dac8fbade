"""What every ``mplug eval`` task shares: the model folder it evaluates, the device and precision it runs in,
where its metrics JSON goes (and its side files, beside it), how the JSON is written (atomically), and the report
of the items (images, videos) an evaluation had to leave out."""
from __future__ import annotations

import os
import re
from collections import Counter

import torch

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.utils.atomic_files import write_json_atomic
from mplug_pretrain.utils.precision import autocast_context


def eval_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_eval_model(cfg, checkpoint: str):
    """A ``save_pretrained`` / ``mplug export`` folder -> MPLUG in eval mode on ``eval_device()``, the ViT
    re-targeted to ``eval.image_size`` when set."""
    from mplug_pretrain.models.folder.hub import resolve_model_folder
    from mplug_pretrain.models.folder.locate import model_folder_problem
    from mplug_pretrain.models.mplug import MPLUG
    checkpoint = resolve_model_folder(checkpoint)  # a Hub id: its snapshot in huggingface_hub's cache
    problem = model_folder_problem(checkpoint)
    if problem:
        raise ConfigError(f"--checkpoint {checkpoint}: {problem}")
    model = MPLUG.from_pretrained(checkpoint, image_size=cfg.eval.image_size)
    return model.to(eval_device()).eval()


def eval_autocast(cfg, model):
    """The precision context (utils/precision.py) to evaluate ``model`` in: bf16 on a GPU when
    ``distributed.precision`` resolves to bf16, fp32 otherwise (on a CPU always)."""
    from mplug_pretrain.config import resolve_precision
    device = next(model.parameters()).device
    precision = "bf16" if device.type == "cuda" and resolve_precision(cfg) == "bf16" else "fp32"
    return autocast_context(precision, device)


def metrics_path(cfg, task: str, out: str | None, checkpoint: str | None = None) -> str:
    """``--out``, else ``eval.output``, else ``<run dir>/metrics_<task>-<checkpoint label>.json`` (without a
    checkpoint ``metrics_<task>.json``): two models evaluated with one config keep both their metrics."""
    stem = f"metrics_{task.replace('-', '_')}" + (f"-{checkpoint_label(checkpoint)}" if checkpoint else "")
    return out or cfg.eval.output or os.path.join(cfg.run_dir, f"{stem}.json")


def checkpoint_label(path: str) -> str:
    """A file-name-safe label for a model folder: ``<run>-<step tag>`` for a run's ``model/`` (or any folder
    directly inside a run folder, one holding ``config.yaml``), the tag read from the run's
    ``checkpoints/latest``; otherwise ``<parent>-<folder>``. ``runs/a/model`` -> ``a-step20``."""
    from mplug_pretrain.train.checkpoint import read_latest

    folder = os.path.abspath(path)
    parent = os.path.dirname(folder)
    if os.path.isfile(os.path.join(parent, "config.yaml")):
        tag = read_latest(os.path.join(parent, "checkpoints"))
        label = f"{os.path.basename(parent)}-{tag or os.path.basename(folder)}"
    else:
        label = f"{os.path.basename(parent)}-{os.path.basename(folder)}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label).strip("-") or "checkpoint"


def beside_metrics(metrics_path: str, name: str) -> str:
    """A side file (predictions, submission) named after its metrics JSON, so two evaluations writing ``a.json``
    and ``b.json`` into one folder never overwrite each other's:
    ``runs/x/eval/val.json`` + ``vqa_submission.json`` -> ``runs/x/eval/val.vqa_submission.json``."""
    path = os.path.abspath(metrics_path)
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(os.path.dirname(path), f"{stem}.{name}")


def write_metrics(path: str, metrics) -> None:
    """The metrics (or predictions) JSON, indented, written atomically (parent folders made)."""
    write_json_atomic(path, metrics)


def real_rows(batch: dict) -> tuple[list[int], torch.Tensor]:
    """The positions of a batch's real (non-filler) examples, as a list and as an index tensor."""
    keep = [i for i, pad in enumerate(batch["is_pad"].tolist()) if not pad]
    return keep, torch.tensor(keep, dtype=torch.long)


MAX_EXAMPLES = 20
TAR_EVENTS = ("truncated_tar", "bad_tar")  # counted per shard, not per item


class SkipReport:
    """Items (videos, images) left out of an evaluation: counts per reason and the first ``MAX_EXAMPLES``
    "name: problem" lines."""

    def __init__(self) -> None:
        self.reasons: Counter[str] = Counter()
        self.examples: list[str] = []

    def add(self, name: str, reason: str, detail: str) -> None:
        self.reasons[reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{name}: {detail}")

    def add_counts(self, counts: dict[str, int]) -> None:
        """Per-sample skip counts of a shard reader (``DecodeStats.skipped``); shard-level events are
        not videos and are left out."""
        self.reasons.update({k: v for k, v in counts.items() if k not in TAR_EVENTS})

    @property
    def total(self) -> int:
        return sum(self.reasons.values())

    def as_dict(self, noun: str = "videos") -> dict:
        return {f"{noun}_skipped": self.total, "skip_reasons": dict(sorted(self.reasons.items())),
                "skipped_examples": list(self.examples)}
