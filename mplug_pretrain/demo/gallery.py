"""A few held-out examples for the demo report: the fine-tuned captioner's captions of validation scenes it
never trained on, and the VQA model's answers to easy-vqa test questions, each beside its image.

    held_out_examples(caption_dir, vqa_dir, shards, out_root, count) -> {"captions": [...], "answers": [...]}
        captions: {"image": PNG path relative to ``out_root`` (the report's folder), "caption": ours, "reference": one human-style caption}
        answers:  {"image": ..., "question": str, "answer": ours, "truth": the most common annotator answer}
The images are written 4x enlarged (nearest neighbour: the 64 px pixels stay visible) to ``out_root``/plots/examples/.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from collections import Counter

from PIL import Image

SCALE = 4
FOLDER = os.path.join("plots", "examples")


def _samples(url: str, image_ext: tuple[str, ...], count: int) -> list[tuple[Image.Image, dict]]:
    """The first ``count`` (image, metadata) pairs of one shard, in shard order."""
    images, metas = {}, {}
    with tarfile.open(url) as tar:
        for member in tar:
            key, _, ext = member.name.partition(".")
            if ext in image_ext:
                images[key] = Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB")
            elif ext == "json":
                metas[key] = json.load(tar.extractfile(member))
            if len([k for k in images if k in metas]) >= count:
                break
    keys = [k for k in images if k in metas][:count]
    return [(images[k], metas[k]) for k in keys]


def _save(image: Image.Image, out_root: str, name: str) -> str:
    os.makedirs(os.path.join(out_root, FOLDER), exist_ok=True)
    image.resize((image.width * SCALE, image.height * SCALE), Image.NEAREST).save(os.path.join(out_root, FOLDER, name))
    return os.path.join(FOLDER, name)


def held_out_examples(caption_dir: str, vqa_dir: str, shards: dict, out_root: str, count: int = 6) -> dict:
    """``shards``: ``demo.shards.ensure_demo_shards`` output (first shard of caption_val and vqa_val is read)."""
    from mplug_pretrain.data.reading.urls import all_shards, expand_sources
    from mplug_pretrain.factory import create_model_and_transforms
    captioner, *_ = create_model_and_transforms(caption_dir)
    scenes = _samples(all_shards(expand_sources(shards["caption_val"]))[0], ("jpg", "png"), count)
    captions = captioner.caption([image for image, _ in scenes])
    vqa, *_ = create_model_and_transforms(vqa_dir)
    questions = _samples(all_shards(expand_sources(shards["vqa_val"]))[0], ("png", "jpg"), count)
    answers = vqa.answer([image for image, _ in questions], [meta["question"] for _, meta in questions])
    return {
        "captions": [{"image": _save(image, out_root, f"caption_{i}.png"), "caption": caption,
                      "reference": meta["captions"][0]}
                     for i, ((image, meta), caption) in enumerate(zip(scenes, captions))],
        "answers": [{"image": _save(image, out_root, f"vqa_{i}.png"), "question": meta["question"],
                     "answer": answer, "truth": _most_common(meta)}
                    for i, ((image, meta), answer) in enumerate(zip(questions, answers))],
    }


def _most_common(meta: dict) -> str:
    answers = [a["answer"] if isinstance(a, dict) else str(a) for a in meta.get("answers", [])]
    return Counter(answers).most_common(1)[0][0] if answers else meta.get("multiple_choice_answer", "")


def gallery_markdown(examples: dict) -> list[str]:
    """Report lines: one table of captioned scenes, one of answered questions (images inline)."""
    lines = ["## Held-out examples", "", "Captions of validation scenes the captioner never saw (beam search):", "",
             "| image | our caption | a reference |", "|---|---|---|"]
    lines += [f"| ![]({e['image']}) | {e['caption']} | {e['reference']} |" for e in examples["captions"]]
    lines += ["", "Answers to easy-vqa test questions:", "", "| image | question | our answer | truth |",
              "|---|---|---|---|"]
    lines += [f"| ![]({e['image']}) | {e['question']} | {e['answer']} | {e['truth']} |" for e in examples["answers"]]
    return lines


def gallery_figure(examples: dict, out_root: str) -> str:
    """One PNG (``out_root``/plots/examples.png): the captioned scenes on top, the answered questions below."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [examples["captions"], examples["answers"]]
    columns = max(len(row) for row in rows)
    figure, axes = plt.subplots(2, columns, figsize=(2.6 * columns, 7.4), squeeze=False)
    for r, row in enumerate(rows):
        for c in range(columns):
            axis = axes[r][c]
            axis.axis("off")
            if c >= len(row):
                continue
            e = row[c]
            axis.imshow(Image.open(os.path.join(out_root, e["image"])))
            text = (f"ours: {e['caption']}" if r == 0 else
                    f"{e['question']}\nours: {e['answer']}  (truth: {e['truth']})")
            axis.set_title("\n".join(textwrap.wrap(text, 28, replace_whitespace=False)), fontsize=8)
    figure.tight_layout()
    path = os.path.join(out_root, "plots", "examples.png")
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
