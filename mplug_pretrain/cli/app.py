"""``mplug <command>``: builds the parser from ``COMMANDS`` (one module per command in cli/commands/), runs the
chosen command and turns the errors a user can fix into one ``mplug: ...`` line and an exit code."""
from __future__ import annotations

import argparse

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
from mplug_pretrain.cli.exit_codes import run_command
from mplug_pretrain.cli.parsing import IntermixedParser

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


def entry() -> None:
    """The ``mplug`` script and ``python -m mplug_pretrain``: ``main``, then the process ends without the
    interpreter's teardown (utils/fast_exit.py). An error that escapes ``main`` exits as usual."""
    from mplug_pretrain.utils.fast_exit import exit_now
    exit_now(main())
