"""``mplug caption --checkpoint DIR IMAGE...``: captions for image files (the library API, model.caption).

An unreadable file (empty, truncated, not an image, beyond PIL's decompression-bomb limit) does not stop the
others: each is listed on stderr ("mplug: skipped PATH: not a readable image (...)"), the readable ones are
captioned, and the exit code is 0; 3 when no image was readable."""
from __future__ import annotations

import sys

from mplug_pretrain.errors import DataError


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
    p.set_defaults(func=run)


def check_model_folder(path: str) -> None:
    """``--checkpoint`` must be a model folder; a run folder is pointed to its model/."""
    from mplug_pretrain.models.folder.locate import model_folder_problem
    problem = model_folder_problem(path)
    if problem:
        raise FileNotFoundError(f"--checkpoint {path}: {problem}")


def run(args) -> int:
    import dataclasses

    from mplug_pretrain.metrics.captions import write_caption_results
    from mplug_pretrain.models.generation.settings import GenerationSettings
    from mplug_pretrain.tasks.caption.predict import image_id_from_path, predict
    check_model_folder(args.checkpoint)
    settings = GenerationSettings.from_model_dir(args.checkpoint)
    overrides = {k: v for k, v in (("prompt", args.prompt), ("beam_size", args.beam_size),
                                   ("max_length", args.max_length), ("min_length", args.min_length)) if v is not None}
    settings = dataclasses.replace(settings, **overrides)
    results, unreadable = predict(args.checkpoint, args.images, settings, args.batch_size, args.tokenizer)
    for path, caption in results:
        print(f"{path}\t{caption}", flush=True)
    for message in unreadable:
        print(f"mplug: skipped {message}", file=sys.stderr)
    if not results:
        raise DataError(f"none of the {len(unreadable)} image(s) could be read")
    if args.out:
        write_caption_results({image_id_from_path(p): c for p, c in results}, args.out)
    if unreadable:
        print(f"mplug: captioned {len(results)} of {len(results) + len(unreadable)} images; "
              f"{len(unreadable)} unreadable (listed above)", file=sys.stderr)
    return 0
