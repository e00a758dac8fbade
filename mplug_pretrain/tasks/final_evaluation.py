"""The evaluation a fine-tuning task runs after its last step, on what it exported."""
from __future__ import annotations

import os
from collections.abc import Callable

from mplug_pretrain.config import Config


def evaluate_exported_model(cfg: Config, tokenizer, evaluate_model: Callable[..., dict]) -> dict:
    """Rank 0 reloads ``<run_dir>/model`` (full precision, whatever the ZeRO stage) and runs
    ``evaluate_model(model, cfg, tokenizer, <run_dir>/metrics.json, checkpoint=<run_dir>/model)``; the other
    ranks wait for it and return {}."""
    from mplug_pretrain.models.mplug import MPLUG
    from mplug_pretrain.utils.process_group import barrier, rank
    metrics: dict = {}
    if rank() == 0:
        model_dir = os.path.join(cfg.run_dir, "model")
        metrics = evaluate_model(MPLUG.from_pretrained(model_dir), cfg, tokenizer,
                                 os.path.join(cfg.run_dir, "metrics.json"), checkpoint=model_dir)
    barrier()
    return metrics
