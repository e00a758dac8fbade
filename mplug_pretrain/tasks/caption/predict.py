"""`mplug caption --checkpoint DIR IMAGE... [--out results.json]`: one caption per image file.

Arguments may be image files or folders (every image inside, sorted: NoCaps-style prediction folders).
Images are read with PIL (RGB) and go through the eval transform at the model's input size; the prompt and
beam settings come from the ``caption_generation.json`` a fine-tuning run saves in the model folder (else
"a picture of", beam 5, max length 20), each overridable. The model comes through the library API
(``create_model_and_transforms``): the folder's tokenizer and preprocessing.json are used. Prints "IMAGE<TAB>caption" per image;
``--out`` also writes the COCO results format [{"image_id", "caption"}] (``image_id_from_path``).
"""
from __future__ import annotations

import os
import re

import torch

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def image_files(paths: list[str]) -> list[str]:
    """Files as given; folders expanded to their image files (sorted)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files.extend(sorted(os.path.join(path, f) for f in os.listdir(path) if f.lower().endswith(IMAGE_EXTENSIONS)))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such image file or folder")
    if not files:
        raise FileNotFoundError(f"no image file in {paths}")
    return files


def image_id_from_path(path: str) -> int | str:
    """COCO_val2014_000000000042.jpg -> 42; 123.jpg -> 123; anything else (NoCaps' hex names) -> the stem."""
    stem = os.path.splitext(os.path.basename(path))[0]
    coco = re.fullmatch(r"COCO_[a-z]+\d*_(\d+)", stem)
    if coco:
        return int(coco.group(1))
    return int(stem) if stem.isdigit() else stem


def load_image(path: str, transform) -> torch.Tensor:
    """The eval-transformed image; ValueError "PATH: not a readable image (why)" for an empty, truncated or
    non-image file, and for one larger than PIL's decompression-bomb limit."""
    from PIL import Image

    from mplug_pretrain.data.formats.image_decode import to_rgb
    try:
        with Image.open(path) as image:
            return transform(to_rgb(image))
    except Exception as err:  # PIL raises OSError, DecompressionBombError, SyntaxError, ValueError...
        raise ValueError(f"{path}: not a readable image ({type(err).__name__}: {err})") from err


def predict(checkpoint: str, paths: list[str], settings, batch_size: int = 16, tokenizer_path: str | None = None):
    """-> ([(file, caption)] for every readable image file of ``paths`` (the library API: model.caption),
    [message] for each unreadable one)."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.factory import create_model_and_transforms
    from mplug_pretrain.utils.process_group import device
    files = image_files(paths)
    model, _, transform, tokenizer = create_model_and_transforms(checkpoint, device=device())
    if tokenizer_path:
        tokenizer = load_tokenizer(tokenizer_path)
        model.attach_inference(tokenizer, transform, model.inference_max_text_len, settings)
    results, unreadable, batch = [], [], []
    for i, path in enumerate(files):
        try:
            batch.append((path, load_image(path, transform)))
        except ValueError as err:
            unreadable.append(str(err))
        if batch and (len(batch) == batch_size or i == len(files) - 1):
            captions = model.caption(torch.stack([image for _, image in batch]), **vars(settings))
            results.extend(zip([path for path, _ in batch], captions))
            batch = []
    return results, unreadable
