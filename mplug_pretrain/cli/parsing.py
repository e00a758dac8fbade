"""Argument-parsing pieces every command shares: a parser that accepts ``key=value`` overrides between options,
the ``--config FILE [key=value ...]`` arguments, and the config they describe."""
from __future__ import annotations

import argparse


class IntermixedParser(argparse.ArgumentParser):
    """Accepts ``key=value`` positionals between options (``mplug finetune caption --config c.yaml k=v --resume
    auto k2=v2``): plain argparse fills every positional at its first chunk and rejects later words. Parsers that
    own sub-commands parse as usual (argparse cannot intermix those)."""
    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        has_subcommands = any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        if self._intermixing or has_subcommands:  # the intermixed parser calls back into this method
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    """``--config FILE`` and the ``key=value`` overrides after it."""
    p.add_argument("--config", required=required, help="YAML run config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr_rest=5e-5")


def load_config_from_args(args: argparse.Namespace, check_paths: bool | str = True):
    """The validated run config named by ``--config`` with the overrides applied."""
    from mplug_pretrain.config import load_config
    return load_config(args.config, args.overrides, check_paths=check_paths)
