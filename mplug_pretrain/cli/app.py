"""``mplug <command>``: builds the parser from ``COMMANDS`` (one module per command in cli/commands/), runs the
chosen command and turns the errors a user can fix into one ``mplug: ...`` line and an exit code."""
from __future__ import annotations

import argparse
import sys

from mplug_pretrain.cli.commands import (
    bench,
    cache_features,
    caption,
    convert,
    demo,
    export,
    make_shards,
    pretrain,
    submit,
    tasks,
)
from mplug_pretrain.cli.parsing import IntermixedParser
from mplug_pretrain.cli.registry import MissingDependencyError, missing_dependency
from mplug_pretrain.errors import ConfigError, DataError, PeerRankError

COMMANDS = {  # command -> the function adding its parser to the `mplug` subparsers, in help order
    "demo": demo.register,
    "make-shards": make_shards.register,
    "pretrain": pretrain.register,
    "finetune": tasks.register_finetune,
    "eval": tasks.register_eval,
    "caption": caption.register,
    "cache-features": cache_features.register,
    "export": export.register,
    "convert": convert.register,
    "submit": submit.register,
    "bench": bench.register,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mplug", description="mPLUG-style vision-language pretraining")
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>", parser_class=IntermixedParser)
    for register in COMMANDS.values():
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """The parsed command, its user-fixable errors turned into one ``mplug: ...`` line and an exit code."""
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"mplug: config error: {err}", file=sys.stderr)
        return 2
    except DataError as err:
        print(f"mplug: data error: {err}", file=sys.stderr)
        return 3
    except PeerRankError as err:
        print(f"mplug: distributed error: {err}", file=sys.stderr)
        return 5
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as err:  # a path given on the command line
        print(f"mplug: {err}", file=sys.stderr)
        return 2
    except MissingDependencyError as err:
        print(f"mplug: missing dependency: {err}", file=sys.stderr)
        return 4
    except ModuleNotFoundError as err:  # a lazy import of a package the command needs
        if (err.name or "").startswith("mplug_pretrain"):
            raise
        print(f"mplug: missing dependency: {missing_dependency(err, f'mplug {args.command}')}", file=sys.stderr)
        return 4


def entry() -> None:
    """The ``mplug`` script and ``python -m mplug_pretrain``: ``main``, then the process ends without the
    interpreter's teardown (utils/fast_exit.py). An error that escapes ``main`` exits as usual."""
    from mplug_pretrain.utils.fast_exit import exit_now
    exit_now(main())
