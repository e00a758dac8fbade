"""`mplug export`: consolidate any ZeRO stage's checkpoint into a self-contained model folder:
``model.safetensors`` + ``config.json`` (``MPLUG.from_pretrained``, no DeepSpeed), the run's tokenizer files and
``preprocessing.json`` (``mplug_pretrain.create_model_and_transforms`` needs nothing else), and the caption
run's ``caption_generation.json`` when its ``model/`` folder has one."""
from __future__ import annotations

import os
import shutil

import torch

from mplug_pretrain.config import Config, load_config
from mplug_pretrain.models.generation_settings import GENERATION_FILE
from mplug_pretrain.models.model_card import write_model_card
from mplug_pretrain.models.preprocessing import write_inference_files
from mplug_pretrain.train.checkpoint import read_latest


def _locate(path: str, tag: str | None) -> tuple[str, str, str]:
    """-> (run_dir, checkpoints dir, tag) from a run folder, its checkpoints/ or a tag folder."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        run_dir, ckpt_dir = path, os.path.join(path, "checkpoints")
    elif os.path.isfile(os.path.join(path, "latest")) or os.path.basename(path) == "checkpoints":
        ckpt_dir, run_dir = path, os.path.dirname(path)
    else:
        ckpt_dir, run_dir = os.path.dirname(path), os.path.dirname(os.path.dirname(path))
        tag = tag or os.path.basename(path)
    tag = tag or read_latest(ckpt_dir)
    if tag is None or not os.path.isdir(os.path.join(ckpt_dir, tag)):
        raise FileNotFoundError(f"{ckpt_dir}: no checkpoint tag found (latest missing?)")
    return run_dir, ckpt_dir, tag


def consolidated_state_dict(ckpt_dir: str, tag: str) -> dict[str, torch.Tensor]:
    """fp32 weights, frozen momentum copies and buffers (queues, pointers) from the ZeRO partitions
    (stage 1-3, DeepSpeed's zero_to_fp32) or from the plain module file (stage 0)."""
    tag_dir = os.path.join(ckpt_dir, tag)
    if any("optim_states" in f for f in os.listdir(tag_dir)):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=tag)
    else:
        # DeepSpeed's own file, written by this user's run; it holds non-tensor objects too
        files = [f for f in os.listdir(tag_dir) if f.endswith("model_states.pt")]
        if not files:
            raise FileNotFoundError(f"{tag_dir}: no DeepSpeed model_states file")
        state = torch.load(os.path.join(tag_dir, min(files)), map_location="cpu", weights_only=False)["module"]
    return {k: v.detach().float().clone() if v.is_floating_point() else v.detach().clone() for k, v in state.items()}


def export_checkpoint(checkpoint: str, out: str, tag: str | None = None) -> str:
    from mplug_pretrain.models.mplug import MPLUG
    run_dir, ckpt_dir, tag = _locate(checkpoint, tag)
    cfg = load_config(os.path.join(run_dir, "config.yaml"), check_paths=False)
    model = MPLUG(cfg.model)
    state = consolidated_state_dict(ckpt_dir, tag)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or missing:
        raise RuntimeError(f"{ckpt_dir}/{tag}: checkpoint does not match the run's model config: "
                           f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.save_pretrained(out)
    complete_model_folder(out, cfg)
    generation = os.path.join(run_dir, "model", GENERATION_FILE)
    if os.path.isfile(generation) and os.path.abspath(out) != os.path.dirname(generation):
        shutil.copy(generation, os.path.join(out, GENERATION_FILE))
    return out


def complete_model_folder(directory: str, cfg: Config) -> None:
    """Make a ``save_pretrained`` folder self-contained: the run's tokenizer files, preprocessing.json and
    the VQA decoding settings (vqa.generation)."""
    write_inference_files(directory, cfg.data.tokenizer, cfg.data.max_text_len)
    cfg.vqa.generation.save(directory)
    save_vqa_answer_list(directory, cfg)
    write_model_card(directory)  # again: the run folder's config is known now


def save_vqa_answer_list(directory: str, cfg: Config) -> None:
    """A VQA run's answer list (vqa.answer_list, else the one written with vqa.train_shards) kept in its model
    folder as ``answer_list.json``, so that `mplug eval vqa vqa.inference=rank` need not be given it again."""
    from mplug_pretrain.data.pipeline import load_answer_list as shards_answer_list
    from mplug_pretrain.data.write_vqa import MODEL_ANSWER_LIST, load_answer_list
    from mplug_pretrain.utils.atomic_files import write_json_atomic
    v = cfg.vqa
    answers = load_answer_list(v.answer_list) if v.answer_list else (
        shards_answer_list(v.train_shards) if v.train_shards else None)
    if answers:
        write_json_atomic(os.path.join(directory, MODEL_ANSWER_LIST), answers, indent=None)
