"""``mplug make-shards synthetic|coco|csv|vqa|snli-ve|nlvr2|grounding|video ... --out DIR``: argument parsing only; each
sub-command calls one ``write_*`` function and prints what it wrote."""
from __future__ import annotations

import argparse
import re

from mplug_pretrain.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"500MB"`` -> 500_000_000 (decimal units; a plain number is bytes)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"--shard-bytes: {text!r} is not a size like 500MB or 3GB")
    return int(float(match.group(1)) * 1000 ** "_KMGT".index(match.group(2).upper() or "_"))


def _common(parser: argparse.ArgumentParser, default_name: str) -> None:
    parser.add_argument("--out", required=True, help="output folder (shards + manifest.json)")
    parser.add_argument("--name", default=default_name, help="shard name prefix: NAME-000000.tar")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    parser.add_argument("--shard-bytes", type=parse_bytes, default=None, help="also cap shard size, e.g. 500MB")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing data set of this name")


def _real_data(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-image-side", type=int, default=None,
                        help="re-encode larger images as JPEG with this longer side (default: copy bytes)")
    parser.add_argument("--skip-missing", action="store_true", help="skip (and count) missing image files")


def _layout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layout", choices=("pair", "image"), default="pair",
                        help="pair: a sample per caption (training); image: a sample per image, all captions in json")


def _sizes(args) -> dict:
    return {"max_samples": args.shard_size, "max_bytes": args.shard_bytes, "overwrite": args.overwrite}


def _report(args, entry: dict) -> int:
    print(f"[make-shards] wrote {entry['total']} samples in {len(entry['shards'])} shard(s) to "
          f"{args.out}/{args.name}-*.tar (manifest: {args.out}/manifest.json)")
    return 0


def run_synthetic(args) -> int:
    from mplug_pretrain.data.writers.synthetic import (
        write_synthetic_image_shards,
        write_synthetic_video_shards,
    )
    if args.kind == "video":
        entry = write_synthetic_video_shards(args.out, num_videos=args.num, seed=args.seed, num_frames=args.num_frames,
                                             size=args.image_size, name=args.name, **_sizes(args))
    else:
        entry = write_synthetic_image_shards(args.out, num_scenes=args.num, captions_per_scene=args.captions_per_scene,
                                             layout=args.layout, seed=args.seed, image_size=args.image_size,
                                             name=args.name, **_sizes(args))
    return _report(args, entry)


def run_classification(args) -> int:
    """``make-shards snli-ve|nlvr2``: --synthetic scenes, or --annotations + --images (the public files)."""
    from mplug_pretrain.data.writers import classification as w
    if args.synthetic:
        write = w.write_synthetic_snli_ve if args.source == "snli-ve" else w.write_synthetic_nlvr2
        entry = write(args.out, num=args.num, seed=args.seed, image_size=args.image_size, name=args.name,
                      **_sizes(args))
    else:
        if not args.annotations or not args.images:
            raise ConfigError(f"make-shards {args.source}: --annotations and --images are required "
                              "(or --synthetic)")
        write = w.write_snli_ve if args.source == "snli-ve" else w.write_nlvr2
        entry = write(args.annotations, args.images, args.out, name=args.name, max_side=args.max_image_side,
                      **_sizes(args))
    return _report(args, entry)


def run_grounding(args) -> int:
    """``make-shards grounding``: --synthetic scenes, or RefCOCO-family annotations + --images."""
    from mplug_pretrain.data.writers import grounding as w
    if args.synthetic:
        entry = w.write_synthetic_grounding(args.out, num=args.num, seed=args.seed, image_size=args.image_size,
                                            name=args.name, **_sizes(args))
    else:
        if not args.images or not (args.annotations or (args.refs and args.instances)):
            raise ConfigError("make-shards grounding: --images and --annotations (or --refs + --instances) are "
                              "required (or --synthetic)")
        entry = w.write_grounding(args.images, args.out, annotations=args.annotations, refs=args.refs,
                                  instances=args.instances, split=args.split, name=args.name,
                                  max_side=args.max_image_side, skip_missing=args.skip_missing, **_sizes(args))
    return _report(args, entry)


def run_coco(args) -> int:
    from mplug_pretrain.data.writers.coco import write_coco_shards
    return _report(args, write_coco_shards(args.annotations, args.images, args.out, split=args.split, layout=args.layout,
                                           name=args.name, max_image_side=args.max_image_side,
                                           skip_missing=args.skip_missing, **_sizes(args)))


def run_csv(args) -> int:
    from mplug_pretrain.data.writers.table import write_table_shards
    return _report(args, write_table_shards(args.table, args.out, image_column=args.image_column,
                                            caption_column=args.caption_column, id_column=args.id_column,
                                            image_root=args.images, sep=args.sep, layout=args.layout, name=args.name,
                                            max_image_side=args.max_image_side, skip_missing=args.skip_missing,
                                            **_sizes(args)))


def run_vqa(args) -> int:
    if args.easy_vqa:
        from mplug_pretrain.data.writers.easy_vqa import write_easy_vqa_shards
        entry = write_easy_vqa_shards(args.out, split=args.split or "train", max_questions=args.max_questions,
                                      seed=args.seed, name=args.name, **_sizes(args))
        return _report(args, entry)
    if not args.questions or not args.images:
        raise ConfigError("make-shards vqa: needs --questions and --images (or --easy-vqa)")
    from mplug_pretrain.data.writers.vqa import write_vqa_shards
    return _report(args, write_vqa_shards(args.questions, args.images, args.out, annotations=args.annotations,
                                          answer_list=args.answer_list, image_pattern=args.image_pattern,
                                          image_info=args.image_info,
                                          name=args.name, max_image_side=args.max_image_side,
                                          skip_missing=args.skip_missing, **_sizes(args)))


def run_video(args) -> int:
    from mplug_pretrain.data.writers.video import write_video_shards
    return _report(args, write_video_shards(args.videos, args.out, annotations=args.annotations,
                                            video_key=args.video_key, caption_key=args.caption_key, name=args.name,
                                            skip_missing=args.skip_missing,
                                            **_sizes(args)))


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("make-shards", help="write WebDataset tar shards + manifest.json",
                                   description="Write WebDataset shards (NAME-%06d.tar) and a manifest.json with "
                                               "per-shard sample counts.")
    kinds = parser.add_subparsers(dest="source", required=True, metavar="synthetic|coco|csv|vqa|snli-ve|nlvr2|grounding|video")

    p = kinds.add_parser("synthetic", help="procedural shapes (images) or moving shapes (mp4 videos)")
    _common(p, "synthetic")
    _layout(p)
    p.add_argument("--kind", choices=("image", "video"), default="image")
    p.add_argument("--num", type=int, default=1000, help="scenes (images) or videos")
    p.add_argument("--captions-per-scene", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-frames", type=int, default=16)
    p.set_defaults(func=run_synthetic)

    p = kinds.add_parser("coco", help="COCO captions JSON or Karpathy dataset_coco.json + image folder")
    _common(p, "coco")
    _layout(p)
    _real_data(p)
    p.add_argument("--annotations", required=True, help="captions_*.json or dataset_coco.json")
    p.add_argument("--images", required=True, help="image root (Karpathy: the folder holding train2014/, val2014/)")
    p.add_argument("--split", default=None, help="Karpathy split(s), e.g. test or train,restval")
    p.set_defaults(func=run_coco)

    p = kinds.add_parser("csv", help="CSV/TSV/JSONL table of image path + caption")
    _common(p, "table")
    _layout(p)
    _real_data(p)
    p.add_argument("--table", required=True)
    p.add_argument("--images", default=None, help="root for relative image paths (default: the table's folder)")
    p.add_argument("--image-column", default="filepath")
    p.add_argument("--caption-column", default="title")
    p.add_argument("--id-column", default=None, help="integer image id column (default: by image path)")
    p.add_argument("--sep", default=None, help="field separator (default: by suffix: .csv ',', .tsv tab)")
    p.set_defaults(func=run_csv)

    p = kinds.add_parser("vqa", help="VQA v2 questions/annotations + images, or --easy-vqa")
    _common(p, "vqa")
    _real_data(p)
    p.add_argument("--questions", default=None, help="VQA questions JSON")
    p.add_argument("--annotations", default=None, help="VQA annotations JSON (absent for test splits)")
    p.add_argument("--images", default=None, help="image folder (ids from trailing digits of file names)")
    p.add_argument("--image-pattern", default=None, help="e.g. COCO_val2014_{image_id:012d}.jpg")
    p.add_argument("--image-info", default=None, help="image id -> file name: a COCO-style JSON with an images "
                                                      "list (id, file_name) or {image_id: file name}")
    p.add_argument("--answer-list", default=None, help="answer list (JSON list or one per line) to store beside")
    p.add_argument("--easy-vqa", action="store_true", help="convert the easy-vqa package's data set instead")
    p.add_argument("--split", default=None, help="easy-vqa split: train or test")
    p.add_argument("--max-questions", type=int, default=None, help="easy-vqa: seeded subset of this size")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_vqa)

    for task, what in (("snli-ve", "SNLI-VE jsonl (or ALBEF ve_*.json) + Flickr30K images"),
                       ("nlvr2", "NLVR2 json lines (or ALBEF nlvr_*.json) + image pairs")):
        p = kinds.add_parser(task, help=f"{what}, or --synthetic scenes")
        _common(p, task.replace("-", "_"))
        p.add_argument("--max-image-side", type=int, default=None,
                       help="re-encode larger images as JPEG with this longer side (default: copy bytes)")
        p.add_argument("--annotations", default=None, help="the annotation file")
        p.add_argument("--images", default=None, help="image root (files found by name anywhere under it)")
        p.add_argument("--synthetic", action="store_true", help="statements about synthetic scenes instead")
        p.add_argument("--num", type=int, default=1000, help="--synthetic: examples")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--image-size", type=int, default=64)
        p.set_defaults(func=run_classification)

    p = kinds.add_parser("grounding", help="RefCOCO / RefCOCO+ / RefCOCOg (refer refs + COCO instances, or "
                                           "records with boxes), or --synthetic scenes")
    _common(p, "grounding")
    _real_data(p)
    p.add_argument("--refs", default=None, help="the refer toolkit's refs: JSON, or refs(unc).p (read as builtin "
                                                "data only: no class is ever unpickled)")
    p.add_argument("--instances", default=None, help="its COCO instances.json (image files, annotation boxes)")
    p.add_argument("--split", default=None, help="with --refs: the refs' split(s), e.g. val or testA,testB")
    p.add_argument("--annotations", default=None, help="records: {image, text, bbox [x,y,w,h]} or ALBEF's "
                                                       "{image, text, ref_id} (with --refs and --instances)")
    p.add_argument("--images", default=None, help="image root (COCO train2014; files found by name below it)")
    p.add_argument("--synthetic", action="store_true", help="referring expressions about synthetic scenes instead")
    p.add_argument("--num", type=int, default=1000, help="--synthetic: examples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=64)
    p.set_defaults(func=run_grounding)

    p = kinds.add_parser("video", help="folder of videos + captions/QA JSON (raw file bytes)")
    _common(p, "video")
    p.add_argument("--videos", required=True)
    p.add_argument("--annotations", default=None, help="JSON/JSONL records or {video: [captions]}")
    p.add_argument("--video-key", default=None, help="record field naming the video (default: video, "
                                                      "clip_name, video_id, videoID or vid)")
    p.add_argument("--caption-key", default=None, help="record field holding the caption(s) (default: caption, "
                                                        "captions or enCap, VATEX's English captions)")
    p.add_argument("--skip-missing", action="store_true")
    p.set_defaults(func=run_video)
    return parser
