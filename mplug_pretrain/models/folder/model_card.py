"""``README.md`` in every model folder: a Hugging Face model card (YAML front matter + Markdown) saying what the
model is, what it was trained on and how, its metrics, and how to load it. Everything is read from the folder
and, when the folder is a run's ``model/``, from the run folder around it (``config.yaml``, ``metrics.json``), so
the card is rewritten as the folder grows (``save_pretrained``, the end of training, ``push_to_hub``).
"""
from __future__ import annotations

import json
import os

import yaml

CARD_FILE = "README.md"


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _run_folder(directory: str) -> tuple[dict | None, dict | None]:
    """(the run config, the final metrics) of the run whose ``model/`` this is, else (None, None)."""
    run_dir = os.path.dirname(os.path.abspath(directory))
    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            run = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None, None
    return (run if isinstance(run, dict) else None), _read_json(os.path.join(run_dir, "metrics.json"))


def _stored_values(weights: str) -> int | None:
    if not os.path.isfile(weights):
        return None
    from safetensors import safe_open
    total = 0
    with safe_open(weights, "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            count = 1
            for size in f.get_slice(key).get_shape():
                count *= size
            total += count
    return total


def _training_lines(run: dict) -> list[str]:
    data, optim, dist, r = (run.get(k) or {} for k in ("data", "optim", "distributed", "run"))
    task_shards = {name: (run.get(name) or {}).get("train_shards") for name in ("caption", "vqa", "retrieval")}
    shards = data.get("train_shards") or next((v for v in task_shards.values() if v), None)
    lines = [f"- run: `{r.get('name')}`"]
    if run.get("init_from"):
        lines.append(f"- initialised from: `{run['init_from']}`")
    lines += [f"- training shards: `{shards}`" if shards else "- training shards: (none recorded)",
              (f"- steps: {optim.get('max_steps')}, batch size {data.get('batch_size')} per rank "
              f"(x {optim.get('grad_accum_steps', 1)} accumulation), lr {optim.get('lr_rest')} "
              f"(vision {optim.get('lr_vision')}), warm-up {optim.get('warmup_steps')}"),
              f"- precision: {dist.get('precision')}, ZeRO stage {dist.get('zero_stage')}"]
    return lines


def render_model_card(directory: str, repo_id: str | None = None) -> str:
    from mplug_pretrain import __version__
    from mplug_pretrain.models.folder.config_io import CONFIG_FILE
    config = _read_json(os.path.join(directory, CONFIG_FILE)) or {}
    run, metrics = _run_folder(directory)
    vision, text, fusion, decoder = (config.get(k) or {} for k in ("vision", "text", "fusion", "decoder"))
    values = _stored_values(os.path.join(directory, "model.safetensors"))
    name = repo_id or (run or {}).get("run", {}).get("name") or os.path.basename(os.path.abspath(directory))
    tags = ["mplug", "vision-language", "image-to-text"]
    if os.path.isfile(os.path.join(directory, "answer_list.json")):
        tags.append("visual-question-answering")
    front = {"library_name": "mplug_pretrain", "pipeline_tag": "image-to-text", "tags": tags}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {name}", "",
             (f"An mPLUG-style vision-language model (preset `{config.get('preset')}`) written by mplug_pretrain "
             f"{__version__}."), "", "## Model", "",
             (f"- vision: `{vision.get('backbone', 'clip_vit')}` ViT, patch {vision.get('patch_size')}, width "
             f"{vision.get('width')}, {vision.get('layers')} layers, {vision.get('image_size')} px input"),
             f"- text encoder: width {text.get('width')}, {text.get('encoder_layers')} layers",
             f"- fusion: {fusion.get('type')}, {fusion.get('layers')} layers, stride {fusion.get('stride')}",
             f"- decoder: {decoder.get('type')}, {decoder.get('layers')} layers",
             f"- weights: {values:,} stored values in model.safetensors (momentum copies and ITC queues included)"
             if values is not None else "- weights: model.safetensors not written yet", "",
             "## Training", ""]
    lines += _training_lines(run) if run else ["No run folder beside this model: training details unknown."]
    lines += ["", "## Metrics", ""]
    numbers = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    lines += ["| metric | value |", "|---|---|", *(f"| {k} | {v:.4g} |" for k, v in numbers.items())] \
        if numbers else ["None recorded yet (the run's metrics.json appears after its final evaluation)."]
    source = repo_id or os.path.abspath(directory)
    lines += ["", "## Use", "", "```python", "from mplug_pretrain.models.mplug import MPLUG", "",
              f'model = MPLUG.from_pretrained("{source}")', "```", "",
              f"or `mplug caption --checkpoint {source} photo.jpg` (a local folder).", ""]
    if run:
        lines += ["## Run config", "", "```yaml", yaml.safe_dump(run, sort_keys=False).strip(), "```", ""]
    return "\n".join(lines)


def write_model_card(directory: str, repo_id: str | None = None) -> str:
    """(Re)writes ``<directory>/README.md``; -> its path."""
    path = os.path.join(directory, CARD_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_model_card(directory, repo_id))
    return path
