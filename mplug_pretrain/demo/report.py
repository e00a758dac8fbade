"""runs/demo/report.md: what the demo did and measured, for a person to read."""
from __future__ import annotations

import os

from mplug_pretrain.demo.gallery import gallery_markdown
from mplug_pretrain.utils.atomic_files import write_text_atomic

ROWS = [  # (metric, the reference it is compared with, title)
    ("retrieval_r1", "retrieval_chance", "Zero-shot image-text retrieval R@1 (%) on held-out scenes"),
    ("video_retrieval_r1", "video_retrieval_chance", "Zero-shot text-video retrieval R@1 (%) on synthetic videos"),
    ("vqa_accuracy", "vqa_majority_baseline", "easy-vqa accuracy (%), official VQA formula"),
    ("caption_cider", "caption_cider_xe", "Held-out caption CIDEr-D after SCST (vs XE only), beam search"),
    ("caption_sample_cider", "caption_sample_cider_xe",
     "Held-out mean CIDEr-D of sampled captions after SCST (vs XE only): the SCST objective"),
]


def write_report(out_root: str, metrics: dict, records: list[dict], examples: dict | None = None) -> str:
    """``examples``: ``demo.gallery.held_out_examples`` output, shown first (images with captions / answers)."""
    lines = ["# mplug demo report", "",
             f"Total time: {metrics.get('total_seconds', 0) / 60:.1f} min on this machine (CPU, fp32).", ""]
    if examples:
        lines += ["![held-out examples](plots/examples.png)", "", *gallery_markdown(examples), ""]
    lines += ["## Figures", "", "| what | ours | reference | |", "|---|---|---|---|"]
    for key, ref_key, title in ROWS:
        if key not in metrics:
            continue
        ours, ref = metrics[key], metrics.get(ref_key)
        note = ""
        if ref is not None and ref > 0:
            note = f"{ours / ref:.1f}x the reference"
        lines.append(f"| {title} | {ours:.2f} | {ref if ref is None else f'{ref:.2f}'} ({ref_key}) | {note} |")
    lines += ["", "## Pretraining", "",
              (f"{metrics.get('pretrain_steps', 0)} steps; mean loss of the first 10 steps "
               f"{metrics.get('pretrain_loss_first10', float('nan')):.3f}, of the last 10 "
               f"{metrics.get('pretrain_loss_last10', float('nan')):.3f}."), ""]
    if records:
        keys = [k for k in records[0] if k.startswith("loss_")]
        lines += ["| loss | first step | last step |", "|---|---|---|"]
        lines += [f"| {k} | {records[0][k]:.3f} | {records[-1][k]:.3f} |" for k in keys]
    lines += ["", "![pretraining losses](plots/pretrain_losses.png)", "",
              "## Time per stage (s)", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in metrics.get("seconds", {}).items()]
    path = os.path.join(out_root, "report.md")
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path
