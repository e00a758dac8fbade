"""``mplug export --checkpoint RUN_DIR --out DIR``: any ZeRO stage of any run kind -> model.safetensors + config.json
(train/export.py). Checkpoint files are read without arbitrary unpickling; a damaged newest tag falls back to the
newest complete one."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("export", help="consolidate a (ZeRO) checkpoint into safetensors + config")
    p.add_argument("--checkpoint", required=True, help="run folder, its checkpoints/ folder, or a tag folder")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the newest complete one, normally latest)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=run)


def run(args) -> int:
    from mplug_pretrain.train.export import export_checkpoint
    out = export_checkpoint(args.checkpoint, args.out, tag=args.tag)
    print(f"exported {out}")
    return 0
