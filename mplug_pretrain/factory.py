"""``create_model_and_transforms``: the one entry point for inference users (open_clip's shape).

    model, train_transform, eval_transform, tokenizer = create_model_and_transforms("runs/demo/pretrain/model")
    model.caption(image); model.similarity(images, texts); model.answer(image, "what color is the circle?")

``preset_or_dir``: a preset name (tiny | base | large: randomly initialised, default tokenizer and CLIP
preprocessing) or a model folder (config.json + model.safetensors, as ``mplug export`` and training runs'
``model/`` write; with its tokenizer files, preprocessing.json, caption_generation.json and
answer_generation.json when present).
Only models/ and data/ (transforms, tokenizer) are imported: no DeepSpeed, no training code.
"""
from __future__ import annotations

import os
import warnings

import torch

from mplug_pretrain.models.folder.preprocessing import PREPROCESSING_FILE, TOKENIZER_FILE, Preprocessing


def _is_model_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def create_model_and_transforms(preset_or_dir: str, device: str | torch.device | None = None,
                                image_size: int | None = None):
    """-> (model in eval mode, train transform, eval transform, tokenizer). Transforms map a PIL RGB image to
    float32 [3, S, S] with S the model's input size; ``image_size`` re-targets a folder's ViT (positions
    resized) and the transforms. ``device``: default cpu."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.models.generation.settings import AnswerSettings, GenerationSettings
    from mplug_pretrain.models.mplug import MPLUG
    from mplug_pretrain.models.presets import PRESETS, apply_overrides, get_preset_config

    if os.path.isdir(preset_or_dir):
        if not _is_model_folder(preset_or_dir):
            raise FileNotFoundError(f"{preset_or_dir}: not a model folder (no config.json); use a run's model/ "
                                    "folder or `mplug export --checkpoint RUN --out DIR`")
        model = MPLUG.from_pretrained(preset_or_dir, image_size=image_size)
        preprocessing, tokenizer = _folder_preprocessing(preset_or_dir, model.config.vision.image_size)
        generation = GenerationSettings.from_model_dir(preset_or_dir)
        answering = AnswerSettings.from_model_dir(preset_or_dir)
    elif preset_or_dir in PRESETS:
        config = get_preset_config(preset_or_dir)
        if image_size is not None:
            config = apply_overrides(config, {"vision.image_size": image_size})
        model = MPLUG(config)
        preprocessing, tokenizer = Preprocessing(image_size=config.vision.image_size), load_tokenizer()
        generation, answering = GenerationSettings(), AnswerSettings()
    else:
        raise ValueError(f"{preset_or_dir!r}: neither a preset ({', '.join(PRESETS)}) nor a model folder")
    model = model.float().to(device or "cpu").eval()
    train_transform, eval_transform = preprocessing.transforms()
    model.attach_inference(tokenizer, eval_transform, preprocessing.max_text_len, generation, answering)
    return model, train_transform, eval_transform, tokenizer


def _folder_preprocessing(directory: str, image_size: int):
    """The folder's preprocessing.json and tokenizer; folders written before they were saved get the
    defaults with a warning."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    if os.path.isfile(os.path.join(directory, PREPROCESSING_FILE)):
        preprocessing = Preprocessing.load(directory)
        preprocessing.image_size = image_size  # the weights' (possibly re-targeted) input size
    else:
        warnings.warn(f"{directory}: no {PREPROCESSING_FILE}; using CLIP mean/std, bicubic, {image_size} px",
                      stacklevel=3)
        preprocessing = Preprocessing(image_size=image_size)
    if os.path.isfile(os.path.join(directory, TOKENIZER_FILE)):
        return preprocessing, load_tokenizer(directory)
    warnings.warn(f"{directory}: no {TOKENIZER_FILE}; using the default bert-base-uncased vocabulary", stacklevel=3)
    return preprocessing, load_tokenizer()
