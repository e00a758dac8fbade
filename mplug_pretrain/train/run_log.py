"""What a user watches: ``log.jsonl`` (one object per step), TensorBoard and/or Weights & Biases
(``run.report_to: [tensorboard, wandb]``), a progress bar on a terminal and plain log lines otherwise
(train/progress.py), and loss plots at the end. Rank 0 only.

wandb: one wandb run per run folder, its files under ``<run dir>/wandb/`` and its id kept in
``<run dir>/wandb_id``, so a resumed run (``--resume``) continues the same wandb run. ``WANDB_MODE=offline``
writes only the local files (``wandb sync`` uploads them later); the resolved config is the run's config."""
from __future__ import annotations

import json
import os
import resource
import secrets
import time
from dataclasses import dataclass

import torch

from mplug_pretrain.utils.atomic_files import atomic_write


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


@dataclass(frozen=True)
class WandbSettings:
    project: str
    name: str
    entity: str | None = None
    config: dict | None = None


def reporters(cfg) -> dict:
    """``RunLog`` keyword arguments from ``run.report_to`` / ``run.tensorboard`` / ``run.wandb_*``."""
    from mplug_pretrain.config_loader import to_dict
    r = cfg.run
    wandb = WandbSettings(r.wandb_project, r.name, r.wandb_entity, to_dict(cfg)) if "wandb" in r.report_to else None
    return {"tensorboard": r.tensorboard and "tensorboard" in r.report_to, "wandb": wandb}


def _start_wandb(run_dir: str, settings: WandbSettings):
    try:
        import wandb
    except ImportError as err:
        from mplug_pretrain.errors import ConfigError
        raise ConfigError("run.report_to: wandb is not installed (pip install 'mplug_pretrain[wandb]', or "
                          "drop wandb from run.report_to)") from err
    id_file = os.path.join(run_dir, "wandb_id")
    if os.path.isfile(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = secrets.token_hex(4)  # wandb ids: lowercase letters and digits
        with atomic_write(id_file) as f:
            f.write(run_id)
    return wandb.init(project=settings.project, entity=settings.entity, name=settings.name, id=run_id,
                      resume="allow", dir=run_dir, config=settings.config)


class RunLog:
    def __init__(self, run_dir: str, total_steps: int, enabled: bool, tensorboard: bool = True,
                 print_every: int = 10, initial_step: int = 0, wandb: WandbSettings | None = None) -> None:
        self.enabled = enabled
        self.print_every = print_every
        self.start = time.time()
        self._file = None
        self._tb = None
        self._wandb = None
        self._progress = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self._file = open(os.path.join(run_dir, "log.jsonl"), "a")  # noqa: SIM115 (open for the whole run)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:
                print("[log] tensorboard not installed; skipping TensorBoard events", flush=True)
        if wandb is not None:
            self._wandb = _start_wandb(run_dir, wandb)
        from mplug_pretrain.train.progress import Progress
        self._progress = Progress(total_steps, initial_step, print_every)

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record["step"]
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(_panel_name(key), value, step)
        if self._wandb is not None:
            self._wandb.log({_panel_name(k): v for k, v in record.items()
                             if k != "step" and isinstance(v, (int, float))}, step=step)
        self._progress.step(record)

    def validation(self, record: dict) -> None:
        """A held-out validation record ({"step", "val_*", ...}): log.jsonl, TensorBoard and wandb (panels
        ``val/...``), and one line on the console; never the progress bar's loss."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k.replace("val_", "val/", 1): v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])
        shown = ", ".join(f"{k} {v:.4g}" for k, v in record.items() if k.startswith("val_") and isinstance(v, float))
        self._progress.event(f"[val] step {record['step']}: {shown}")

    def event(self, message: str) -> None:
        if self.enabled:
            self._progress.event(message)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._file is not None:
            self._file.close()


def _panel_name(key: str) -> str:
    """``loss_itc`` -> ``loss/itc``, ``lr_vision`` -> ``lr/vision``: one panel group per kind."""
    return key.replace("lr_", "lr/").replace("loss_", "loss/")


def read_log(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_log(run_dir: str, last_step: int) -> int:
    """On resume, drop records of steps after the checkpoint (they are trained again), so the log
    holds each step of the resumed trajectory once. Returns how many records were dropped."""
    records = read_log(run_dir)
    kept = [r for r in records if r.get("step", 0) <= last_step]
    if len(kept) == len(records):
        return 0
    with atomic_write(os.path.join(run_dir, "log.jsonl")) as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    return len(records) - len(kept)


def plot_losses(run_dir: str, out_name: str = "losses.png", smooth: int = 10,
                records: list[dict] | None = None) -> str | None:
    """One panel per loss key, raw and moving average, from log.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(run_dir) if records is None else records
    keys = sorted({k for r in records for k in r if k.startswith("loss")})
    if not records or not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        points = [(r["step"], r[key]) for r in records if key in r]
        steps, values = zip(*points)
        ax.plot(steps, values, alpha=0.35, lw=0.8)
        if len(values) >= smooth:
            avg = [sum(values[max(0, i - smooth + 1): i + 1]) / len(values[max(0, i - smooth + 1): i + 1])
                   for i in range(len(values))]
            ax.plot(steps, avg, lw=1.5)
        ax.set_title(key)
        ax.set_xlabel("step")
    fig.tight_layout()
    os.makedirs(os.path.join(run_dir, "plots"), exist_ok=True)
    path = os.path.join(run_dir, "plots", out_name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
