"""Shared benchmark plumbing: machine description, timing, and the JSON form every bench writes:
{"bench": NAME, "machine": {...}, "rows": [flat objects with named fields], ...extra}."""
from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from mplug_pretrain.utils.atomic_files import write_json_atomic


def machine_info() -> dict:
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def median_seconds(fn: Callable[[], None], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_seconds(fns: dict[str, Callable[[], None]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Wall times of each ``fns`` entry over ``rounds`` rounds, every round calling each once, the order reversed
    every other round (a load change then hits every entry alike); ``warmup`` untimed rounds first."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for round_index in range(warmup + rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fns[name]()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def write_bench(name: str, rows: list[dict], out: str, **extra) -> dict:
    """Write the bench JSON to ``out`` (a file, or a folder -> ``out/NAME.json``); returns it."""
    result = {"bench": name, "machine": machine_info(), "rows": rows, **extra}
    if out.endswith("/") or os.path.isdir(out):
        out = os.path.join(out, f"{name.replace('-', '_')}.json")
    write_json_atomic(out, result)
    return result


def pretrain_batch(preset: str, batch_size: int) -> dict:
    """One pretraining batch from the demo shards at ``preset``'s image size (text padded to 30 tokens)."""
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.demo.shards import ensure_demo_shards
    from mplug_pretrain.models.presets import get_preset_config
    image_size = get_preset_config(preset).vision.image_size
    spec = LoaderSpec(ensure_demo_shards()["pretrain_train"], batch_size, rank=0, world_size=1)
    loader = build_pretrain_loader(spec, load_tokenizer(), image_size=image_size, max_text_len=30, augment=True)
    return next(iter(loader))
