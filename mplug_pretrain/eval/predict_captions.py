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
    from PIL import Image

    from mplug_pretrain.data.image_decode import to_rgb
    try:
        with Image.open(path) as image:
            return transform(to_rgb(image))
    except OSError as err:
        raise ValueError(f"{path}: not a readable image ({err})") from err


def predict(checkpoint: str, paths: list[str], settings, batch_size: int = 16, tokenizer_path: str | None = None):
    """-> [(file, caption)] for every image file of ``paths`` (the library API: model.caption)."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.factory import create_model_and_transforms
    from mplug_pretrain.process_group import device
    files = image_files(paths)
    model, _, transform, tokenizer = create_model_and_transforms(checkpoint, device=device())
    if tokenizer_path:
        tokenizer = load_tokenizer(tokenizer_path)
        model.attach_inference(tokenizer, transform, model.inference_max_text_len, settings)
    results = []
    for start in range(0, len(files), batch_size):
        chunk = files[start:start + batch_size]
        images = torch.stack([load_image(f, transform) for f in chunk])
        results.extend(zip(chunk, model.caption(images, **vars(settings))))
    return results


def cmd_caption(args) -> int:
    import dataclasses

    from mplug_pretrain.eval.caption_metrics import write_caption_results
    from mplug_pretrain.models.generation_settings import GenerationSettings
    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        raise FileNotFoundError(f"--checkpoint: {args.checkpoint} is not a model folder (no config.json)")
    settings = GenerationSettings.from_model_dir(args.checkpoint)
    overrides = {k: v for k, v in (("prompt", args.prompt), ("beam_size", args.beam_size),
                                   ("max_length", args.max_length), ("min_length", args.min_length)) if v is not None}
    settings = dataclasses.replace(settings, **overrides)
    results = predict(args.checkpoint, args.images, settings, args.batch_size, args.tokenizer)
    for path, caption in results:
        print(f"{path}\t{caption}", flush=True)
    if args.out:
        write_caption_results({image_id_from_path(p): c for p, c in results}, args.out)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("caption", help="caption image files with a fine-tuned model folder")
    p.add_argument("--checkpoint", required=True, help="a model folder (a run's model/, or `mplug export`)")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files or folders of images")
    p.add_argument("--prompt", default=None, help="default: the model folder's caption_generation.json, else "
                                                  "'a picture of'")
    p.add_argument("--beam-size", type=int, default=None)
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--min-length", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--tokenizer", default=None, help="folder with vocab.txt (default: bert-base-uncased's)")
    p.add_argument("--out", default=None, help="also write the captions in the COCO results format")
    p.set_defaults(func=cmd_caption)
