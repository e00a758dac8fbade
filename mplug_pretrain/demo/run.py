"""`mplug demo`: the main job on the embedded default, on CPU, in minutes.

    data_shards/ (made on first use) -> pretrain the tiny preset (ITC+ITM+MLM+PrefixLM, DeepSpeed, 2 ranks)
    -> zero-shot image-text retrieval on held-out scenes -> caption fine-tuning (XE, then SCST)
    -> VQA fine-tuning on the real easy-vqa data -> zero-shot text-video retrieval on synthetic videos
    -> runs/demo/metrics.json, runs/demo/report.md (with held-out images, their captions and answers),
       runs/demo/plots/*.png (losses; examples.png: the same examples in one picture)

``quick=True`` (``mplug demo --quick``) runs every stage on a few dozen steps: a check that an
installation works end to end (the test suite's demo run), not the demo's figures.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import shutil
import time

from mplug_pretrain.config import load_config
from mplug_pretrain.demo.caption_stage import caption_demo
from mplug_pretrain.demo.gallery import gallery_figure, held_out_examples
from mplug_pretrain.demo.report import write_report
from mplug_pretrain.demo.retrieval_stage import retrieval_demo, video_retrieval_demo
from mplug_pretrain.demo.vocab import vocab_size
from mplug_pretrain.demo.vqa_stage import vqa_demo
from mplug_pretrain.utils.atomic_files import write_json_atomic
from mplug_pretrain.utils.resources import config_file

DEMO_CONFIG = config_file("demo.yaml")

QUICK_PRETRAIN = ["optim.max_steps=30", "optim.warmup_steps=5", "optim.alpha_warmup_steps=10", "run.log_every=10"]

# Pretraining runs as `mplug pretrain --nproc 2` (forked ranks, gloo, one thread per rank; data.batch_size is per
# rank): one process with one thread left the second core idle. One rank of 24 with two threads (OpenMP's short
# spin, docs/configuration.md "CPU threads") is as fast and retrieves better, but its captioner lost beam CIDEr-D under SCST
# on a fresh clone (bench/NOTES.md "Demo: one rank of 24 with two threads"), so the demo keeps two ranks.
PRETRAIN_RANKS = 2
# a process group's environment: the demo's child processes start groups of their own, never the parent's
PROCESS_GROUP_VARIABLES = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")

# Two lanes of stages, run side by side after pretraining (one process and one torch thread each: on 2 cores
# that beats 2 threads in one process, docs/configuration.md "CPU threads"); each stage(pretrained_dir, shards, run_root,
# quick) -> {metric: value}. The lanes take about the same time.
LANES = [
    [("caption fine-tuning (XE then SCST)", caption_demo)],
    [("zero-shot image-text retrieval", retrieval_demo), ("VQA fine-tuning on easy-vqa", vqa_demo),
     ("zero-shot text-video retrieval", video_retrieval_demo)],
]


def _run_lane(lane_index: int, pretrained: str, shards: dict, out_root: str, quick: bool) -> list[tuple[str, dict, float]]:
    """One lane in a process of its own -> [(stage name, its metrics, its seconds)]; log in ``out_root``/lane<i>.log."""
    import sys

    import torch
    torch.set_num_threads(1)
    for key in PROCESS_GROUP_VARIABLES:
        os.environ.pop(key, None)  # the parent's single-rank group: each lane starts its own on a free port
    done = []
    with open(os.path.join(out_root, f"lane{lane_index}.log"), "w") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):  # file descriptors, not just sys.stdout: compilers DeepSpeed probes write there too
            os.dup2(log.fileno(), fd)
        for title, stage in LANES[lane_index]:
            start = time.time()
            result = stage(pretrained, shards, out_root, quick)
            done.append((stage.__name__, result, time.time() - start))
            print(f"[demo] {title}: " + _format(result), flush=True)
    return done


def _format(result: dict) -> str:
    return ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())


def _print_shard_summary(shards: dict) -> None:
    from mplug_pretrain.data.formats.manifest import shard_sample_counts
    from mplug_pretrain.data.reading.urls import all_shards, expand_sources
    print("[demo] embedded data (data_shards/):", flush=True)
    for name, pattern in shards.items():
        if pattern.endswith(".tar") or "{" in pattern:
            urls = all_shards(expand_sources(pattern))
            print(f"  {name:15s} {len(urls)} shard(s), {sum(shard_sample_counts(urls))} samples  {pattern}", flush=True)


def run_demo(out_root: str = "runs/demo", shards_root: str = "data_shards", overrides: list[str] | None = None,
             quick: bool = False) -> dict:
    import torch

    from mplug_pretrain.demo.shards import ensure_demo_shards
    from mplug_pretrain.train.run_log import plot_losses, read_log
    torch.set_num_threads(1)  # one thread per process throughout the demo (docs/configuration.md "CPU threads")
    start = time.time()
    shards = ensure_demo_shards(shards_root)
    _print_shard_summary(shards)
    timings = {"shards": time.time() - start}
    pretrain_overrides = [f"data.train_shards={shards['pretrain_train']}", f"run.output_dir={out_root}",
                          f"data.tokenizer={shards['tokenizer']}",
                          f"model.text.vocab_size={vocab_size(shards['tokenizer'])}",
                          "run.name=pretrain", *(QUICK_PRETRAIN if quick else []), *(overrides or [])]
    cfg = load_config(DEMO_CONFIG, pretrain_overrides)  # a bad override fails here, before any rank starts
    if os.path.isdir(cfg.run_dir):
        shutil.rmtree(cfg.run_dir)  # the demo always starts from scratch
    print(f"[demo] pretraining the {cfg.model.preset} preset for {cfg.optim.max_steps} steps "
          f"({PRETRAIN_RANKS} ranks x batch {cfg.data.batch_size}, ZeRO-{cfg.distributed.zero_stage}, "
          f"{cfg.distributed.precision})", flush=True)
    _pretrain_on_ranks(pretrain_overrides)
    pretrained = os.path.join(cfg.run_dir, "model")
    timings["pretrain"] = time.time() - start - timings["shards"]
    metrics: dict = {}
    for index, lane in enumerate(LANES):
        print(f"[demo] lane {index}: " + ", then ".join(title for title, _ in lane) +
              f" (log: {os.path.join(out_root, f'lane{index}.log')})", flush=True)
    for index, done in enumerate(_run_lanes(pretrained, shards, out_root, quick)):
        for (title, _), (name, result, seconds) in zip(LANES[index], done):
            metrics.update(result)
            timings[name] = seconds
            print(f"[demo] {title}: {_format(result)}", flush=True)
    records = read_log(cfg.run_dir)
    metrics["pretrain_steps"] = len(records)
    metrics["pretrain_loss_first10"] = _mean([r["loss"] for r in records[:10]])
    metrics["pretrain_loss_last10"] = _mean([r["loss"] for r in records[-10:]])
    metrics["seconds"] = {k: round(v, 1) for k, v in timings.items()}
    metrics["total_seconds"] = round(time.time() - start, 1)
    os.makedirs(os.path.join(out_root, "plots"), exist_ok=True)
    plot_losses(cfg.run_dir)
    shutil.copy(os.path.join(cfg.run_dir, "plots", "losses.png"), os.path.join(out_root, "plots", "pretrain_losses.png"))
    examples = held_out_examples(metrics["caption_model_dir"], metrics["vqa_model_dir"], shards, out_root)
    gallery_figure(examples, out_root)
    write_json_atomic(os.path.join(out_root, "metrics.json"), metrics)
    write_report(out_root, metrics, records, examples)
    print(f"[demo] done in {metrics['total_seconds'] / 60:.1f} min: {out_root}/metrics.json, "
          f"{out_root}/report.md, {out_root}/plots/", flush=True)
    return metrics


def _pretrain_on_ranks(overrides: list[str]) -> None:
    """``mplug pretrain --config demo.yaml --nproc PRETRAIN_RANKS OVERRIDES`` in a child process (its output goes
    to ours; it forks its ranks where it can: utils/fork_launch.py); raises if it fails."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in PROCESS_GROUP_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    sys.stdout.flush()
    command = [sys.executable, "-m", "mplug_pretrain", "pretrain", "--config", DEMO_CONFIG,
               "--nproc", str(PRETRAIN_RANKS), *overrides]
    if subprocess.run(command, env=env, check=False).returncode != 0:
        raise RuntimeError(f"demo pretraining failed: {' '.join(command)}")


def _can_fork() -> bool:
    """Whether child processes can be forked from this one (Linux, no CUDA device, one thread: utils/fork_launch.py);
    the parent's process-group variables are dropped first (each child starts a group of its own)."""
    from mplug_pretrain.utils.fork_launch import prepare_fork
    for key in PROCESS_GROUP_VARIABLES:
        os.environ.pop(key, None)
    return prepare_fork() is None


def _run_lanes(pretrained: str, shards: dict, out_root: str, quick: bool) -> list[list[tuple[str, dict, float]]]:
    """Every lane side by side, each in a process of its own -> per lane [(stage name, its metrics, its seconds)].
    Forked from this process where they can be (it imported every stage already; the pool forks its workers
    before it starts a thread), else fresh interpreters (no forked DeepSpeed / OpenMP state)."""
    context = multiprocessing.get_context("fork" if _can_fork() else "spawn")
    with concurrent.futures.ProcessPoolExecutor(len(LANES), mp_context=context) as pool:
        lanes = [pool.submit(_run_lane, i, pretrained, shards, out_root, quick) for i in range(len(LANES))]
        return [future.result() for future in lanes]


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)
