"""`mplug demo`: the main job on the embedded default, on CPU, in minutes.

    data_shards/ (made on first use) -> pretrain the tiny preset (ITC+ITM+MLM+PrefixLM, DeepSpeed)
    -> zero-shot image-text retrieval on held-out scenes -> caption fine-tuning (XE, then SCST)
    -> VQA fine-tuning on the real easy-vqa data -> zero-shot text-video retrieval on synthetic videos
    -> runs/demo/metrics.json, runs/demo/report.md, runs/demo/plots/*.png
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import time

from mplug_pretrain.config import load_config
from mplug_pretrain.resources import config_file

DEMO_CONFIG = config_file("demo.yaml")

# (metric-producing stage, module, function), run in this order
STAGES = [
    ("zero-shot image-text retrieval", "mplug_pretrain.eval.zero_shot_demo", "retrieval_demo"),
    ("caption fine-tuning (XE then SCST)", "mplug_pretrain.train.caption_demo", "caption_demo"),
    ("VQA fine-tuning on easy-vqa", "mplug_pretrain.train.vqa_demo", "vqa_demo"),
    ("zero-shot text-video retrieval", "mplug_pretrain.eval.zero_shot_demo", "video_retrieval_demo"),
]


def _stage_function(module_name: str, function_name: str):
    return getattr(importlib.import_module(module_name), function_name)


def _print_shard_summary(shards: dict) -> None:
    from mplug_pretrain.data.manifest import shard_sample_counts
    from mplug_pretrain.data.urls import all_shards, expand_sources
    print("[demo] embedded data (data_shards/):", flush=True)
    for name, pattern in shards.items():
        if pattern.endswith(".tar") or "{" in pattern:
            urls = all_shards(expand_sources(pattern))
            print(f"  {name:15s} {len(urls)} shard(s), {sum(shard_sample_counts(urls))} samples  {pattern}", flush=True)


def run_demo(out_root: str = "runs/demo", shards_root: str = "data_shards", overrides: list[str] | None = None) -> dict:
    from mplug_pretrain.data.demo_shards import ensure_demo_shards
    from mplug_pretrain.train.pretrain import run_pretrain
    from mplug_pretrain.train.run_log import plot_losses, read_log

    start = time.time()
    shards = ensure_demo_shards(shards_root)
    _print_shard_summary(shards)
    cfg = load_config(DEMO_CONFIG, [f"data.train_shards={shards['pretrain_train']}", f"run.output_dir={out_root}",
                                    "run.name=pretrain", *(overrides or [])])
    if os.path.isdir(cfg.run_dir):
        shutil.rmtree(cfg.run_dir)  # the demo always starts from scratch
    print(f"[demo] pretraining the {cfg.model.preset} preset for {cfg.optim.max_steps} steps "
          f"(batch {cfg.data.batch_size}, ZeRO-{cfg.distributed.zero_stage}, {cfg.distributed.precision})", flush=True)
    run_pretrain(cfg)
    pretrained = os.path.join(cfg.run_dir, "model")
    timings = {"pretrain": time.time() - start}
    metrics: dict = {}
    for title, module_name, function_name in STAGES:
        fn = _stage_function(module_name, function_name)
        print(f"[demo] {title} ...", flush=True)
        t = time.time()
        kwargs = {"run_root": out_root} if "run_root" in fn.__code__.co_varnames else {}
        result = fn(pretrained, shards, **kwargs)
        metrics.update(result)
        timings[function_name] = time.time() - t
        print(f"[demo] {title}: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in result.items()), flush=True)
    records = read_log(cfg.run_dir)
    metrics["pretrain_steps"] = len(records)
    metrics["pretrain_loss_first10"] = _mean([r["loss"] for r in records[:10]])
    metrics["pretrain_loss_last10"] = _mean([r["loss"] for r in records[-10:]])
    metrics["seconds"] = {k: round(v, 1) for k, v in timings.items()}
    metrics["total_seconds"] = round(time.time() - start, 1)
    os.makedirs(os.path.join(out_root, "plots"), exist_ok=True)
    plot_losses(cfg.run_dir)
    shutil.copy(os.path.join(cfg.run_dir, "plots", "losses.png"), os.path.join(out_root, "plots", "pretrain_losses.png"))
    with open(os.path.join(out_root, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    from mplug_pretrain.demo_report import write_report
    write_report(out_root, metrics, records)
    print(f"[demo] done in {metrics['total_seconds'] / 60:.1f} min: {out_root}/metrics.json, "
          f"{out_root}/report.md, {out_root}/plots/", flush=True)
    return metrics


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def cmd_demo(args) -> int:
    from mplug_pretrain.train.distributed import shutdown_distributed
    try:
        run_demo(args.out, args.shards, args.overrides)
    finally:
        shutdown_distributed()
    return 0


def register_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job on the embedded data_shards/ (CPU, minutes)")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--shards", default="data_shards", help="where the demo shards live (made on first use)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of configs/demo.yaml (pretraining)")
    p.set_defaults(func=cmd_demo)
