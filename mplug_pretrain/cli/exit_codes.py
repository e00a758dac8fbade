"""``run_command``: a parsed ``mplug`` command run, the errors a user can fix turned into one ``mplug: ...`` line and
an exit code (2 config or a path, 3 data, 4 a missing dependency, 5 another rank). Used by ``cli.app.main`` and by
each forked rank of ``mplug pretrain --nproc N`` (utils/fork_launch.py)."""
from __future__ import annotations

import argparse
import sys

from mplug_pretrain.cli.registry import MissingDependencyError, missing_dependency
from mplug_pretrain.errors import ConfigError, DataError, PeerRankError


def run_command(args: argparse.Namespace) -> int:
    """The parsed command, its user-fixable errors turned into one ``mplug: ...`` line and an exit code. A command's
    ``key=value`` overrides are checked first for a shard range the shell expanded (``refuse_expanded_brace_ranges``)."""
    from mplug_pretrain.config_loader import refuse_expanded_brace_ranges
    try:
        refuse_expanded_brace_ranges(getattr(args, "overrides", None) or [])
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
