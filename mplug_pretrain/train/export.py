"""`mplug export`: consolidate any ZeRO stage's checkpoint of any run kind (pretraining, caption stages incl.
cached-feature ones, VQA, retrieval, SNLI-VE / NLVR2) into a self-contained model folder:
``model.safetensors`` + ``config.json`` (``MPLUG.from_pretrained``, no DeepSpeed), the run's tokenizer files and
``preprocessing.json`` (``mplug_pretrain.create_model_and_transforms`` needs nothing else), and for caption runs
their decoding settings (``caption_generation.json``).

The architecture is the trained module's own (``model_config.json`` in the tag; a caption run's captioner has no
momentum encoders and maybe another decoder than its config's preset). The weights are the module's state dict
(every parameter, frozen ones included, and the buffers) overlaid with the fp32 masters of the ZeRO partitions
(DeepSpeed's zero_to_fp32). Every file is read without arbitrary unpickling (train/checkpoint.py). A multi-stage
caption folder exports its last stage that has a checkpoint; a damaged newest tag falls back to the newest
complete one, as resume does."""
from __future__ import annotations

import os
import pickle
import re
import shutil

import torch

from mplug_pretrain.config import Config, load_config
from mplug_pretrain.models.folder.model_card import write_model_card
from mplug_pretrain.models.folder.preprocessing import write_inference_files
from mplug_pretrain.models.generation.settings import GENERATION_FILE
from mplug_pretrain.models.weights.reader import UnsafeFileError, refused_object, weights_only_loads
from mplug_pretrain.train.checkpoint import (
    MODEL_CONFIG,
    CheckpointError,
    deepspeed_safe_globals,
    read_marker,
    refuse_unsafe_tag,
    resolve_resume,
)

_STAGE = re.compile(r"^(\d+)_")


def _stage_folder(path: str) -> str | None:
    """The last stage sub-folder (``<i>_<name>``, highest i) of a multi-stage run that has checkpoints."""
    stages = sorted((int(m.group(1)), name) for name in os.listdir(path)
                    if (m := _STAGE.match(name)) and os.path.isdir(os.path.join(path, name, "checkpoints")))
    return os.path.join(path, stages[-1][1]) if stages else None


def _locate(path: str, tag: str | None) -> tuple[str, str, str]:
    """-> (run_dir, checkpoints dir, tag) from a run folder, a multi-stage run folder, its checkpoints/ or a tag
    folder."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such folder (expected a run folder, its checkpoints/ or a tag folder)")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        run_dir, ckpt_dir = path, os.path.join(path, "checkpoints")
    elif os.path.isfile(os.path.join(path, "latest")) or os.path.basename(path) == "checkpoints":
        ckpt_dir, run_dir = path, os.path.dirname(path)
    elif any(name.endswith("model_states.pt") for name in os.listdir(path)):
        ckpt_dir, run_dir = os.path.dirname(path), os.path.dirname(os.path.dirname(path))
        tag = tag or os.path.basename(path)
    elif (stage := _stage_folder(path)) is not None:
        print(f"[export] {path} is a multi-stage run: exporting its last stage, {os.path.basename(stage)} "
              "(name another stage's folder to export that one)", flush=True)
        run_dir, ckpt_dir = stage, os.path.join(stage, "checkpoints")
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        raise CheckpointError(f"{path}: already a model folder (config.json + model.safetensors): use it as it is")
    else:
        raise CheckpointError(f"{path}: not a run folder (no checkpoints/, no stage folders with checkpoints)")
    chosen, warnings = resolve_resume(tag or "latest", ckpt_dir)
    for warning in warnings:
        print(warning.replace("[train]", "[export]"), flush=True)
    return run_dir, ckpt_dir, chosen


def consolidated_state_dict(ckpt_dir: str, tag: str) -> dict[str, torch.Tensor]:
    """fp32 weights, frozen parameters and buffers (queues, pointers): the module's state dict overlaid with the
    fp32 masters of the ZeRO partitions (stage 1-3, DeepSpeed's zero_to_fp32); stage 0 has no partitions and its
    module holds the masters."""
    tag_dir = os.path.join(ckpt_dir, tag)
    refuse_unsafe_tag(tag_dir)
    files = sorted(f for f in os.listdir(tag_dir) if f.endswith("model_states.pt"))
    if not files:
        raise CheckpointError(f"{tag_dir}: no DeepSpeed model_states file")
    try:
        with weights_only_loads(deepspeed_safe_globals()):  # zero_to_fp32 passes weights_only=False itself
            module = torch.load(os.path.join(tag_dir, files[0]), map_location="cpu", weights_only=True)["module"]
            # ZeRO-3 leaves empty placeholders where a parameter is partitioned
            state = {k: v for k, v in module.items() if v.numel() > 0}
            if any("optim_states" in f for f in os.listdir(tag_dir)):
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
                state.update(get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=tag))
    except pickle.UnpicklingError as err:  # what the scan could not see (a legacy-format file)
        raise UnsafeFileError(f"{tag_dir}: refused: {refused_object(err)}") from err
    except (EOFError, RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{tag_dir}: cannot be read (half-written or damaged?): {err}; export another tag "
                              "with --tag") from err
    return {k: v.detach().float().clone() if v.is_floating_point() else v.detach().clone() for k, v in state.items()}


def _model(run_dir: str, tag_dir: str, cfg: Config):
    """The trained module's architecture: the tag's model_config.json, else (tags written before it existed) a
    finished run's model/config.json, else the run config's model section."""
    from mplug_pretrain.models.folder.config_io import read_model_config, without_weight_paths
    from mplug_pretrain.models.mplug import MPLUG
    for path in (os.path.join(tag_dir, MODEL_CONFIG), os.path.join(run_dir, "model", "config.json")):
        if os.path.isfile(path):
            return MPLUG(read_model_config(path)), path
    return MPLUG(without_weight_paths(cfg.model)), os.path.join(run_dir, "config.yaml")  # the tag has the weights


def export_checkpoint(checkpoint: str, out: str, tag: str | None = None) -> str:
    run_dir, ckpt_dir, tag = _locate(checkpoint, tag)
    tag_dir = os.path.join(ckpt_dir, tag)
    config_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{config_path}: missing; export needs the run folder the checkpoint belongs to")
    cfg = load_config(config_path, check_paths=False)
    model, source = _model(run_dir, tag_dir, cfg)
    state = consolidated_state_dict(ckpt_dir, tag)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or missing:
        raise CheckpointError(f"{tag_dir}: the weights do not fit the architecture of {source}: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}; a finished run's model/ folder is a "
                              "model folder already")
    model.save_pretrained(out)
    complete_model_folder(out, cfg)
    generation = os.path.join(run_dir, "model", GENERATION_FILE)
    if os.path.isfile(generation) and os.path.abspath(out) != os.path.dirname(generation):
        shutil.copy(generation, os.path.join(out, GENERATION_FILE))
    elif str((read_marker(tag_dir) or {}).get("task", "")).startswith("caption"):
        cfg.caption.generation.save(out)  # the prompt the captioner was trained with
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
    from mplug_pretrain.data.reading.pipeline import load_answer_list as shards_answer_list
    from mplug_pretrain.data.writers.vqa import MODEL_ANSWER_LIST, load_answer_list
    from mplug_pretrain.utils.atomic_files import write_json_atomic
    v = cfg.vqa
    answers = load_answer_list(v.answer_list) if v.answer_list else (
        shards_answer_list(v.train_shards) if v.train_shards else None)
    if answers:
        write_json_atomic(os.path.join(directory, MODEL_ANSWER_LIST), answers, indent=None)
