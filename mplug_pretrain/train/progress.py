"""What the user sees while training: a live tqdm bar (loss, samples/s, MFU, ETA) when stderr is a
terminal, plain ``[train]`` lines otherwise (log files, Slurm, CI). Rank 0 only.

Plain lines come every ``print_every`` steps and always for the first and the last step, so even a run
shorter than ``print_every`` says what it did."""
from __future__ import annotations

import os
import sys

FALLBACK_COLUMNS, FALLBACK_ROWS = 120, 24


def _terminal_columns(stream) -> int:
    """The terminal's width; 0 for a pseudo-terminal nobody sized (ssh -T, script, pty.openpty())."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def _fmt_mfu(mfu: float | None) -> str:
    return f"{100 * mfu:.1f}%" if mfu is not None else "n/a"


class Progress:
    def __init__(self, total_steps: int, initial_step: int = 0, print_every: int = 10, stream=None,
                 bar: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total = total_steps
        self.print_every = max(1, print_every)
        self.first_step = initial_step + 1
        use_bar = self.stream.isatty() if bar is None else bar
        self._bar = None
        if use_bar:
            from tqdm import tqdm
            # on a 0x0 terminal tqdm hides the bar (position >= 0 rows): the run looked silent (issue 20)
            sized = _terminal_columns(self.stream) > 0
            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", file=self.stream, desc="train",
                             dynamic_ncols=sized, ncols=None if sized else FALLBACK_COLUMNS,
                             nrows=None if sized else FALLBACK_ROWS)

    def step(self, record: dict) -> None:
        step = record["step"]
        if self._bar is not None:
            postfix = {"loss": f"{record.get('loss', float('nan')):.3f}",
                       "sps": f"{record.get('samples_per_s', 0):.1f}"}
            if record.get("mfu") is not None:
                postfix["mfu"] = _fmt_mfu(record["mfu"])
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)
            return
        if step % self.print_every and step != self.first_step and step != self.total:
            return
        losses = " ".join(f"{k}={v:.4f}" for k, v in record.items() if k.startswith("loss"))
        lrs = " ".join(f"{k}={v:.2e}" for k, v in record.items()
                       if k.startswith("lr_") and k.endswith("_decay") and not k.endswith("no_decay"))
        mfu = f" mfu={_fmt_mfu(record['mfu'])}" if record.get("mfu") is not None else ""
        print(f"[train] step {step}/{self.total} samples {record.get('samples_seen')} {losses} {lrs} "
              f"sps={record.get('samples_per_s', 0):.1f}{mfu} data={record.get('data_time', 0):.3f}s "
              f"({record.get('data_wait_share', 0):.0%} of the step) "
              f"step={record.get('step_time', 0):.3f}s", flush=True)

    def event(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=self.stream)  # above the bar, which stays intact
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
