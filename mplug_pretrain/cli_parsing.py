"""An ArgumentParser that accepts ``key=value`` positionals between options
(``mplug finetune caption --config c.yaml k=v --resume auto k2=v2``): plain argparse fills every
positional at its first chunk and rejects later words. Parsers that own sub-commands parse as usual
(argparse cannot intermix those)."""
from __future__ import annotations

import argparse


class IntermixedParser(argparse.ArgumentParser):
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
