"""The ``mplug`` command line, all of it: ``app.py`` (the parser, the command list and error handling), ``parsing.py`` (shared
argument pieces), ``registry.py`` (tasks and benchmarks by name), ``commands/`` (one module per command).
``python -m mplug_pretrain`` and the ``mplug`` script both call ``app.entry`` (``main``, then an exit without the
interpreter's teardown)."""
from mplug_pretrain.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
