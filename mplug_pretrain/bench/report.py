"""Benchmark report: bench/results/*.json -> bench/README.md (tables of the latest figures, each row with its
machine and the command that made it, each table with one paragraph on how to read it) and PNG plots in
bench/plots/. `python -m mplug_pretrain.bench.report`. The README's hand-written "## Findings" section (from that
heading to the end) is kept when it is regenerated; dated findings and experiments live in bench/NOTES.md.

Every comparison row reads ours, the peer, and ratio = how many times ours is ahead (peer time / our time, our
rate / peer rate, or peer bytes / our bytes), so a ratio above 1 means ours is ahead and below 1 behind.
"""
from __future__ import annotations

import argparse
import json
import os

from mplug_pretrain.config import REPO_ROOT
from mplug_pretrain.utils.atomic_files import write_text_atomic


def _load(results: str, name: str) -> dict | None:
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _machine(result: dict) -> str:
    m = result["machine"]
    threads = (f"{result['threads_per_rank']} thread(s) per rank" if "threads_per_rank" in result
               else f"{m.get('torch_threads')} threads")
    device = m.get("gpu") or f"{m.get('cpu')} ({m.get('cpu_count')} cores, {threads})"
    return f"{m.get('hostname')}: {device}, torch {m.get('torch')}"


def _cmd(bench: str) -> str:
    return f"`mplug bench {bench} --out bench/results/{bench.replace('-', '_')}.json`"


def _fmt(x: float, unit: str = "") -> str:
    if x >= 100:
        return f"{x:,.0f}{unit}"
    return f"{x:.3g}{unit}"


def _mb(b: float) -> str:
    return f"{b / 2**20:.1f} MB"


def comparison_rows(results: str) -> tuple[list[list[str]], list[str]]:
    rows, notes = [], []

    def add(area, what, ours, peer, ratio, result, bench):
        rows.append([area, what, ours, peer, f"{ratio:.2f}x", _machine(result), _cmd(bench)])
        if ratio < 1:
            notes.append(f"{area} / {what}")

    if (r := _load(results, "data_peer")):
        for row in r["rows"]:
            add("data", f"WebDataset pipeline, {row['workers']} worker(s), batch {r['batch_size']}, "
                f"{r['image_size']} px (samples/s)", _fmt(row["ours_samples_per_s"]),
                f"open_clip get_wds_dataset {_fmt(row['open_clip_samples_per_s'])}", row["ratio"], r, "data-peer")
    if (r := _load(results, "cider")):
        peers = {row["df"]: row for row in r["rows"] if row["implementation"].startswith("pycocoevalcap")}
        for row in r["rows"]:
            if "speedup_vs_pycocoevalcap" in row:
                add("CIDEr-D", f"{r['hypotheses']} hypotheses, df = {row['df']} (s); max |diff| "
                    f"{row['max_abs_diff']:.1e}", _fmt(row["seconds"], " s"),
                    f"pycocoevalcap {_fmt(peers[row['df']]['seconds'], ' s')}", row["speedup_vs_pycocoevalcap"],
                    r, "cider")
    if (r := _load(results, "attention_peer")):
        for row in r["rows"]:
            what = (f"{row['module']} fwd+bwd, width {row['width']}, {row['layers']} layers, batch {row['batch']}, "
                    f"{row['tokens']} tokens" + (f", memory {row['memory_tokens']}" if "memory_tokens" in row else ""))
            add("attention", what, _fmt(row["ours_seconds"], " s"),
                f"transformers ({row['transformers_attn_implementation']}) {_fmt(row['transformers_seconds'], ' s')}",
                row["ratio"], r, "attention-peer")
    if (r := _load(results, "vision_tower")):
        for row in r["rows"]:
            add("vision tower", f"our ViT vs timm {r['timm_model']}, {row['mode']}, {row['width']} wide, "
                f"{row['layers']} layers, batch {row['batch']}, {row['image_size']} px, fp32",
                _fmt(row["ours_seconds"], " s"), f"timm {_fmt(row['timm_seconds'], ' s')}", row["ratio"], r,
                "vision-tower")
    if (r := _load(results, "fusion")):
        by = {(row["variant"], row["visual_tokens"]): row for row in r["rows"]}
        for tokens in sorted({row["visual_tokens"] for row in r["rows"]}):
            for ours in ("skip_s3", "skip_s6"):
                for peer in ("all_connected", "two_stream"):
                    if (ours, tokens) in by and (peer, tokens) in by:
                        o, p = by[(ours, tokens)], by[(peer, tokens)]
                        add("fusion", f"{ours} vs {peer}, {tokens} visual tokens (s / 100 samples, fwd)",
                            _fmt(o["seconds_per_100"], " s"), f"{peer} {_fmt(p['seconds_per_100'], ' s')}",
                            p["seconds_per_100"] / o["seconds_per_100"], r, "fusion")
    if (r := _load(results, "generate")):
        # packed: True / False for ours with the cache since packed decoding (None before it and for the peer)
        by = {(row["implementation"], row["decoder"], row["beam"], row["cache"], row.get("packed")): row
              for row in r["rows"]}
        for beam in sorted({row["beam"] for row in r["rows"]}):
            cached = by.get(("ours", "bert", beam, True, True)) or by.get(("ours", "bert", beam, True, None))
            plain = by.get(("ours", "bert", beam, True, False))
            uncached = by.get(("ours", "bert", beam, False, None))
            if cached and plain:
                add("generation", f"bert decoder, beam {beam}, cached: packed vs plain weights (captions/s)",
                    _fmt(cached["captions_per_s"]), f"plain {_fmt(plain['captions_per_s'])}",
                    cached["captions_per_s"] / plain["captions_per_s"], r, "generate")
            if cached and uncached:
                add("generation", f"bert decoder, beam {beam}: cached vs uncached (captions/s)",
                    _fmt(cached["captions_per_s"]), f"uncached {_fmt(uncached['captions_per_s'])}",
                    cached["captions_per_s"] / uncached["captions_per_s"], r, "generate")
            peer = by.get(("transformers", "bert", beam, True, None))
            if cached and peer:
                add("generation", f"bert decoder, beam {beam}, cached: ours vs transformers generate (captions/s)",
                    _fmt(cached["captions_per_s"]), f"transformers {_fmt(peer['captions_per_s'])}",
                    cached["captions_per_s"] / peer["captions_per_s"], r, "generate")
    if (r := _load(results, "train_step")):
        for row in r["rows"]:
            if row["preset"] == "tiny" and row["ranks"] == max(x["ranks"] for x in r["rows"]) \
                    and not row["grad_checkpointing"] and row["zero_stage"] > 0:
                zero0 = row["state_total_bytes"] / row["state_total_vs_zero0"]
                add("memory", f"per-rank params+grads+optimizer state, tiny, {row['ranks']} ranks, fp32: "
                    f"ZeRO-{row['zero_stage']} vs ZeRO-0", _mb(row["state_total_bytes"]), f"ZeRO-0 {_mb(zero0)}",
                    1 / row["state_total_vs_zero0"], r, "train-step")
    if (r := _load(results, "feature_cache")):
        for objective, speedup in r.get("step_speedup_cached_vs_end_to_end", {}).items():
            cached = next(x for x in r["rows"] if x["mode"] == "cached_features" and x["objective"] == objective)
            e2e = next(x for x in r["rows"] if x["mode"] == "end_to_end" and x["objective"] == objective)
            add("feature cache", f"{r['preset']} caption {objective} step, cached features vs end to end (s/step)",
                _fmt(cached["seconds_per_step"], " s"), f"end to end {_fmt(e2e['seconds_per_step'], ' s')}",
                speedup, r, "feature-cache")
    return rows, notes


def train_step_rows(results: str) -> list[list[str]]:
    r = _load(results, "train_step")
    if r is None:
        return []
    return [[row["preset"], str(row["ranks"]), str(row["zero_stage"]), "on" if row["grad_checkpointing"] else "off",
             str(row["batch_per_rank"]), f"{row['step_seconds']:.2f}", f"{row['samples_per_s']:.3g}",
             f"{row['peak_rss_mb']:,.0f}", _mb(row["state_parameters_bytes"]), _mb(row["state_gradients_bytes"]),
             _mb(row["state_optimizer_bytes"]), _mb(row["state_total_bytes"]),
             f"{row['state_total_vs_zero0']:.2f}" if row["state_total_vs_zero0"] else "-",
             _mb(row["zero_paper_mixed_precision_bytes"]) if "zero_paper_mixed_precision_bytes" in row else "-"]
            for row in r["rows"]]


def gpu_train_step_rows(results: str) -> list[list[str]]:
    """One row per GPU case of train_step_gpu.json: the largest batch that fit and its step figures."""
    r = _load(results, "train_step_gpu")
    if r is None:
        return []
    rows = []
    for row in r["rows"]:
        fits = f" ({row['oom_at']} OOM)" if row.get("oom_at") else " (limit, no OOM)"
        rows.append([row["preset"], str(row["zero_stage"]), "on" if row["grad_checkpointing"] else "off",
                     f"{row['batch_per_rank']}{fits}", f"{row['step_seconds']:.3f}", f"{row['samples_per_s']:.0f}",
                     f"{row['peak_gpu_memory_mb'] / 1024:.1f} GiB", f"{100 * row['mfu']:.1f} %"])
    return rows


BUCKETS = ("matmul", "attention", "elementwise", "copies", "optimizer", "idle")


def gpu_lease_rows(results: str, name: str) -> list[list[str]]:
    """One row per measured case of a ``bench/gpu_lease.py`` result (cases that failed are left out): package,
    preset, ZeRO, compile, step, samples/s, MFU at the padded and at a real text length, and the device time of
    one step in the profile's buckets (ms)."""
    r = _load(results, name)
    if r is None:
        return []
    rows = []
    for row in r["rows"]:
        if row.get("error") or not row.get("samples_per_s"):
            continue
        buckets = row.get("profile", {}).get("buckets_s", {})
        rows.append([row["label"], row["preset"], str(row["zero_stage"]), "compiled" if row["compile"] else "eager",
                     f"{row['step_seconds']:.3f}", f"{row['samples_per_s']:.0f}", f"{100 * row['mfu']:.1f} %",
                     f"{100 * row['mfu_real_length']:.1f} %",
                     " / ".join(f"{1000 * buckets.get(b, 0.0):.0f}" for b in BUCKETS)])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _table_section(title: str, result: dict, command: str, reading: str, header: list[str],
                   rows: list[list[str]]) -> list[str]:
    """A report section: heading, the machine and command, how to read the table, the result's note, the table."""
    return [f"## {title}", "", f"Machine: {_machine(result)}. Command: {command}. {reading} {result.get('note', '')}",
            "", _table(header, rows), ""]


def make_plots(results: str, plots: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(plots, exist_ok=True)
    made = []
    if (r := _load(results, "fusion")):
        fig, ax = plt.subplots(figsize=(6, 4))
        variants = list(dict.fromkeys(row["variant"] for row in r["rows"]))
        for v in variants:
            pts = sorted((row["visual_tokens"], row["seconds_per_100"]) for row in r["rows"] if row["variant"] == v)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
        ax.set(xlabel="visual tokens", ylabel="seconds per 100 samples (forward)", title="Fusion designs")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(plots, "fusion_vs_visual_tokens.png"), dpi=110)
        made.append("fusion_vs_visual_tokens.png")
    if (r := _load(results, "generate")):
        fig, ax = plt.subplots(figsize=(6, 4))
        def key(row: dict) -> tuple:
            return row["implementation"], row["decoder"], row["cache"], row.get("packed")
        for impl, dec, cache, packed in dict.fromkeys(key(row) for row in r["rows"]):
            pts = sorted((row["beam"], row["captions_per_s"]) for row in r["rows"]
                         if key(row) == (impl, dec, cache, packed))
            weights = {True: " packed", False: " plain", None: ""}[packed]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if cache else ":",
                    label=f"{impl} {dec} {'cached' if cache else 'uncached'}{weights}")
        ax.set(xlabel="beam size", ylabel="captions / s", yscale="log", title="Decoding speed vs beam")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(plots, "decode_speed_vs_beam.png"), dpi=110)
        made.append("decode_speed_vs_beam.png")
    if (r := _load(results, "train_step")):
        tiny = [row for row in r["rows"] if row["preset"] == "tiny"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ranks in sorted({row["ranks"] for row in tiny}):
            for ckpt in (False, True):
                pts = sorted((row["zero_stage"], row["samples_per_s"], row["state_total_bytes"]) for row in tiny
                             if row["ranks"] == ranks and row["grad_checkpointing"] == ckpt)
                label = f"{ranks} rank(s), checkpointing {'on' if ckpt else 'off'}"
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
                if not ckpt:
                    axes[1].plot([p[0] for p in pts], [p[2] / 2**20 for p in pts], marker="o", label=f"{ranks} rank(s)")
        axes[0].set(xlabel="ZeRO stage", ylabel="samples / s", title="Tiny preset train step (fp32, CPU)")
        axes[1].set(xlabel="ZeRO stage", ylabel="MB per rank", title="Params + grads + optimizer state per rank")
        for ax in axes:
            ax.set_xticks([0, 1, 2, 3])
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(plots, "train_step_vs_zero_stage.png"), dpi=110)
        made.append("train_step_vs_zero_stage.png")
    return made


def write_report(results: str, readme: str, plots: str, findings: str | None = None) -> str:
    rows, behind = comparison_rows(results)
    made = make_plots(results, plots)
    parts = ["# Benchmarks", "",
             ("Latest figures from `bench/results/*.json` (all of them: `mplug bench all --out bench/results/`; this "
              "page: `python -m mplug_pretrain.bench.report`). How to run and read them: docs/benchmarks.md; what "
              "was learned from them, dated: [NOTES.md](NOTES.md)."), "",
             "## Ours vs peers", "",
             ("One row per comparison, ours and the peer measured in the same run. ratio = how many times ours is "
              "ahead (peer time / our time, our rate / peer rate, peer bytes / our bytes): above 1 ours is ahead, "
              "below 1 behind. Compare rows only on the same machine: wall times on a shared CPU machine carry its "
              "load, the ratio much less."), "",
             _table(["area", "measure", "ours", "peer", "ratio", "machine", "command"], rows), ""]
    if behind:
        parts += ["Rows where ours is behind: " + "; ".join(behind) + " (see NOTES.md).", ""]
    cpu_step = _load(results, "train_step")
    if (ts := train_step_rows(results)):
        parts += _table_section(
            "Pretraining step (DeepSpeed, fp32, CPU, gloo)", cpu_step, _cmd("train-step"),
            "One row per (preset, ranks, ZeRO stage, gradient checkpointing). State columns are per rank, measured "
            "from the engine's tensors (mplug_pretrain/bench/zero_memory.py): read down a ZeRO column at 2 ranks to "
            "see what each stage partitions; at 1 rank ZeRO 1-3 add an fp32 master partition, so they hold more than "
            "ZeRO-0. Peak RSS is the process's resident memory, max over ranks; the last column is what the ZeRO "
            "paper's bf16 mixed-precision accounting would give.",
            ["preset", "ranks", "ZeRO", "ckpt", "batch/rank", "s/step", "samples/s", "peak RSS MB", "params", "grads",
             "optimizer", "total state", "vs ZeRO-0", "ZeRO paper, bf16 mixed"], ts)
    if (gpu := gpu_train_step_rows(results)):
        parts += _table_section(
            "Pretraining step on a GPU (bf16)", _load(results, "train_step_gpu"),
            "`mplug bench train-step --out bench/results/train_step_gpu.json` on a GPU (the calls are listed under "
            "`runs` in the JSON)",
            "One row per (preset, ZeRO stage, checkpointing) at the largest batch that fit, the batch doubled until "
            "out of memory; MFU = model FLOPs per second (train/flops.py) over the card's dense bf16 peak, so rows "
            "compare across presets and batches.",
            ["preset", "ZeRO", "ckpt", "largest batch", "step (s)", "samples/s", "peak GPU memory", "MFU"], gpu)
    for name in ("gpu_lease_before", "gpu_lease_after"):
        if (lease := gpu_lease_rows(results, name)):
            parts += _table_section(
                f"GPU lease: {name.removeprefix('gpu_lease_')}", _load(results, name),
                "`python bench/gpu_lease.py --out DIR --cases ...` (the cases are in the note)",
                "One row per case, batch 128, 30 text tokens, bf16. before = the package before the throughput work, "
                "after = this one, measured in the same lease where both appear. MFU at 15 tokens keeps the samples/s "
                "and counts the FLOPs of a real caption length. The last column is one step's device time (ms) by "
                "kind of kernel, from torch.profiler; idle = wall time the GPU had no kernel.",
                ["package", "preset", "ZeRO", "compile", "step (s)", "samples/s", "MFU (30 tok)", "MFU (15 tok)",
                 "ms: " + " / ".join(BUCKETS)], lease)
    if made:
        parts += ["## Plots", "", ("Fusion: forward time against the number of visual tokens per design (lower is "
                                   "faster). Decoding: captions/s against beam size, log scale, solid lines cached. "
                                   "Train step: samples/s and per-rank state against the ZeRO stage."), ""]
        parts += [f"![{m}](plots/{m})" for m in made] + [""]
    if findings:
        parts += ["## Findings", "", findings.strip(), ""]
    text = "\n".join(parts)
    write_text_atomic(readme, text)
    return text


def existing_findings(readme: str) -> str | None:
    if not os.path.exists(readme):
        return None
    with open(readme) as f:
        text = f.read()
    head = "## Findings\n"
    return text.split(head, 1)[1] if head in text else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=os.path.join(REPO_ROOT, "bench", "results"))
    parser.add_argument("--readme", default=os.path.join(REPO_ROOT, "bench", "README.md"))
    parser.add_argument("--plots", default=os.path.join(REPO_ROOT, "bench", "plots"))
    args = parser.parse_args()
    write_report(args.results, args.readme, args.plots, existing_findings(args.readme))
    print(f"wrote {args.readme}")


if __name__ == "__main__":
    main()
