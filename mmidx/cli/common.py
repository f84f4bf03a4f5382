"""What every command module of the CLI shares: argument conventions, help formatting and registration.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

from mmidx.format import SUFFIXES

EXIT_STATUSES = """exit status: 0 success; 1 failure (bad or missing file, bad data, a problem found), reported in
one line naming the path and the cause; 2 usage error (unknown option, bad value)."""


def dataset_prefix(value: str) -> str:
    """A dataset prefix as the user may give it: ``ds/t2i``, or one of its files (``ds/t2i.idx``,
    ``ds/t2i.bin``, ``ds/t2i.meta.json``...). A suffix is kept when it is part of a prefix whose
    files exist (``x.bin`` with ``x.bin.idx`` beside it)."""
    for suffix in SUFFIXES.values():
        if value.endswith(suffix) and not os.path.exists(value + SUFFIXES["idx"]):
            return value.removesuffix(suffix)
    return value


def _dataset_prefixes(paths: Sequence[str]) -> list[str]:
    """The datasets named on the command line: prefixes as given, or every dataset of each data YAML."""
    from mmidx.config import DataConfig

    prefixes = []
    for path in paths:
        if path.endswith((".yaml", ".yml")):
            config = DataConfig.from_yaml(path)
            prefixes += [prefix for group in config.groups for prefix in group.datasets]
        else:
            prefixes.append(dataset_prefix(path))
    return prefixes


Commands = Any  # the object argparse's add_subparsers returns


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless it has none (None, False) or says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == ():
            return action.help or ""
        return super()._get_help_string(action) or ""


def add_command(commands: Commands, name: str, handler: Callable[[argparse.Namespace], int],
                help: str) -> argparse.ArgumentParser:
    """Register subcommand ``name``."""
    sub = commands.add_parser(name, help=help, description=help, epilog=EXIT_STATUSES,
                              formatter_class=HelpFormatter)
    sub.set_defaults(handler=handler, usage_error=sub.error)  # usage_error(message): usage, the line, exit 2
    return sub


PREFIX_HELP = "dataset prefix (path without .idx/.bin; a path to one of its files is accepted too)"


PATHS_HELP = "dataset prefixes (paths or URIs: s3://bucket/prefix), or data YAMLs (every dataset of every group)"


