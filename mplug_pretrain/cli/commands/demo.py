"""``mplug demo [--out DIR] [--shards DIR] [--quick] [key=value ...]``: the main job on the embedded default."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("demo", help="the main job on the embedded data_shards/ (CPU, minutes)")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--shards", default="data_shards", help="where the demo shards live (made on first use)")
    p.add_argument("--quick", action="store_true",
                   help="every stage on a few dozen steps: checks an installation, not the figures")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of configs/demo.yaml (pretraining)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mplug_pretrain.demo.run import run_demo
    from mplug_pretrain.train.distributed import shutdown_distributed
    try:
        run_demo(args.out, args.shards, args.overrides, quick=args.quick)
    finally:
        shutdown_distributed()
    return 0
