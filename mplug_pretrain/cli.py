"""`mplug <command>`: parses arguments, builds the config, calls a task. Nothing else lives here."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from mplug_pretrain.cli_parsing import IntermixedParser
from mplug_pretrain.command_registry import COMMANDS, MissingDependencyError, missing_dependency, resolve
from mplug_pretrain.errors import ConfigError, DataError


def _config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", required=required, help="YAML run config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr_rest=5e-5")


def _load(args, check_paths: bool = True):
    from mplug_pretrain.config import load_config
    return load_config(args.config, args.overrides, check_paths=check_paths)


def _relaunch_with_torchrun(nproc: int) -> int:
    """`--nproc N` on one machine: re-run this very command under torchrun with N ranks."""
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--nproc")
    del argv[i:i + 2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(_free_port()), "-m", "mplug_pretrain.cli", *argv]
    return subprocess.call(cmd)


def _free_port() -> int:
    from mplug_pretrain.train.distributed import _free_port as free
    return free()


def cmd_pretrain(args) -> int:
    cfg = _load(args)  # validate before anything starts, also before a relaunch
    if args.nproc and args.nproc > 1 and "RANK" not in os.environ:
        return _relaunch_with_torchrun(args.nproc)
    from mplug_pretrain.train.distributed import shutdown_distributed
    from mplug_pretrain.train.pretrain import run_pretrain
    try:
        run_pretrain(cfg, resume=args.resume)  # a preempted run saved and exits 0; Slurm requeues it
    finally:
        shutdown_distributed()
    return 0


def cmd_export(args) -> int:
    from mplug_pretrain.train.export import export_checkpoint
    out = export_checkpoint(args.checkpoint, args.out, tag=args.tag)
    print(f"exported {out}")
    return 0


def cmd_bench(args) -> int:
    from mplug_pretrain.bench.registry import run_bench
    result = run_bench(args.name, args.out, quick=args.quick)
    if isinstance(result, dict) and "rows" in result:
        for row in result["rows"]:
            print(json.dumps(row))
    return 0


def register_pretrain(sub) -> None:
    p = sub.add_parser("pretrain", help="pretrain on WebDataset shards (DeepSpeed ZeRO)")
    _config_args(p)
    p.add_argument("--resume", default=None, help="latest | auto (latest if present) | a checkpoint tag")
    p.add_argument("--nproc", type=int, default=0, help="ranks on this machine (relaunches under torchrun)")
    p.set_defaults(func=cmd_pretrain)


def register_export(sub) -> None:
    p = sub.add_parser("export", help="consolidate a (ZeRO) checkpoint into safetensors + config")
    p.add_argument("--checkpoint", required=True, help="run folder, its checkpoints/ folder, or a tag folder")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_export)


def register_bench(sub) -> None:
    from mplug_pretrain.command_registry import BENCHES
    p = sub.add_parser("bench", help="benchmarks that write JSON")
    p.add_argument("name", choices=sorted(BENCHES) + ["all"])
    p.add_argument("--out", required=True, help="output JSON file (or folder for `all`)")
    p.add_argument("--quick", action="store_true", help="small sizes (used by the tests)")
    p.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mplug", description="mPLUG-style vision-language pretraining")
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>", parser_class=IntermixedParser)
    for target in COMMANDS.values():
        module_name, _, function_name = target.partition(":")
        own = module_name in (__name__, getattr(__spec__, "name", None))  # also under `python -m`
        (globals()[function_name] if own else resolve(target))(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"mplug: config error: {err}", file=sys.stderr)
        return 2
    except DataError as err:
        print(f"mplug: data error: {err}", file=sys.stderr)
        return 3
    except MissingDependencyError as err:
        print(f"mplug: missing dependency: {err}", file=sys.stderr)
        return 4
    except ModuleNotFoundError as err:  # a lazy import of a package the command needs
        if (err.name or "").startswith("mplug_pretrain"):
            raise
        print(f"mplug: missing dependency: {missing_dependency(err, f'mplug {args.command}')}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
