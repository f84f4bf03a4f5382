"""What every command module of the CLI shares: argument conventions, help formatting and registration.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
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


# How help names an argument: the same words for the same thing in every command.
PREFIX = "PREFIX"  # one dataset prefix (path without .idx/.bin)
PREFIX_OR_DATA_YAML = "PREFIX_OR_DATA_YAML"  # dataset prefixes, or a data.yaml naming them

# The order ``mmidx --help`` lists the commands in: the pipeline's, from raw data to training.
PIPELINE = ("build", "merge", "inspect", "verify", "sample", "export", "fetch", "cache", "precache", "index", "show",
            "bench", "view", "demo")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The help of every command: paragraphs wrapped at the terminal's width (at most 100 columns), and every
    option's help ending in argparse's ``(default: …)``, unless it has none (None, False) or says it already.

    Help that must say more than a value (``None`` meaning "the source's choice") writes it the same way:
    ``(default: …)`` at the end, as :func:`default_note` does."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        kwargs.setdefault("width", max(40, min(shutil.get_terminal_size().columns - 2, 100)))
        super().__init__(prog, **kwargs)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Each paragraph (blank-line separated) wrapped on its own."""
        return "\n\n".join(super(HelpFormatter, self)._fill_text(paragraph, width, indent)
                           for paragraph in text.split("\n\n"))

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == ():
            return action.help or ""
        return super()._get_help_string(action) or ""


def human_bytes(size: float) -> str:
    """A size as people read it: ``123 B``, ``4.5 MB`` (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def default_note(help: str, default: str) -> str:
    """``help`` ending in a default that is not a plain value, written as argparse writes the others."""
    return f"{help} (default: {default})"


def at_least(minimum: float, kind: type = int) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` no smaller than ``minimum``, or a usage error (exit 2) saying so."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value >= minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'} "
                                             f">= {minimum}")
        return value
    parse.__name__ = f"{kind.__name__} >= {minimum}"
    return parse


def add_command(commands: Commands, name: str, handler: Callable[[argparse.Namespace], int],
                help: str) -> argparse.ArgumentParser:
    """Register subcommand ``name``."""
    sub = commands.add_parser(name, help=help, description=help, epilog=EXIT_STATUSES,
                              formatter_class=HelpFormatter)
    sub.set_defaults(handler=handler, usage_error=sub.error)  # usage_error(message): usage, the line, exit 2
    return sub


def in_pipeline_order(commands: Commands) -> None:
    """List the registered commands in :data:`PIPELINE` order (others after them) in ``--help``."""
    def rank(name: str) -> int:
        return PIPELINE.index(name) if name in PIPELINE else len(PIPELINE)

    commands._choices_actions.sort(key=lambda action: rank(action.dest))  # argparse lists help from these
    commands.choices = dict(sorted(commands.choices.items(), key=lambda item: rank(item[0])))


def add_pack_arguments(sub: argparse.ArgumentParser, num_samples: bool = True, history: bool = False) -> None:
    """The options of every command that builds packs (``index``, ``show``, ``bench``): what to pack, and
    the model geometry (:class:`mmidx.config.ModelGeometry`) the packs are laid out for; ``--num-samples``
    where the command lets the user choose the stream's length; ``--history`` (instead of a config) where a
    run's mixture history can be replayed."""
    sub.add_argument("config", nargs="*" if history else "+", metavar=PREFIX_OR_DATA_YAML,
                     help="a data.yaml, or dataset prefixes (one group each, with BAGEL's transforms for their "
                          "source and a geometry that holds what those output)")
    if history:
        sub.add_argument("--history", metavar="HISTORY_JSON",
                         help="instead of a config: a run's mixture history (mixture_history.json, which the "
                              "loader writes): its configs, each from the pack where it took over")
    if num_samples:
        sub.add_argument("--num-samples", type=at_least(1),
                         help=default_note("samples drawn into the stream, from the groups by weight",
                                           "the total of all datasets' samples; not one epoch of each dataset "
                                           "unless the weights are proportional to their sizes"))
    else:
        sub.set_defaults(num_samples=None)
    add_cache_arguments(sub, indices=True)
    sub.add_argument("--seed", type=int, help=default_note("seed of the shuffles and draws", "the config's"))
    add_geometry_arguments(sub)


def _size(text: str) -> int:
    """An argparse type: a size in bytes (:func:`mmidx.io.cache_folder.parse_size`), or a usage error saying why."""
    from mmidx.io.cache_folder import CacheError, parse_size

    try:
        return parse_size(text)
    except CacheError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_cache_arguments(sub: argparse.ArgumentParser, indices: bool = False, limit: bool = True) -> None:
    """``--cache-dir`` and ``--cache-limit`` of every command that reads datasets (:func:`cache_options` applies
    them to every reader of the command, as ``MMIDX_CACHE_DIR`` and ``MMIDX_CACHE_LIMIT`` do); ``indices``: the
    command caches the indices it builds there too; ``limit``: it reads data by byte range (not whole files)."""
    what = "mmidx's cache folder: remote datasets' small files" + (" and, with --cache-limit, data blocks" * limit)
    sub.add_argument("--cache-dir", metavar="DIR", help=default_note(
        what + ("; the indices built are cached there too" if indices else ""),
        "$MMIDX_CACHE_DIR, else ~/.cache/mmidx" + ("; indices built in memory" if indices else "")))
    if limit:
        sub.add_argument("--cache-limit", type=_size, metavar="BYTES", help=default_note(
            "turn on the data cache of remote datasets: the bytes it may take on this node, shared by its processes "
            "(500G, 1.5T, 64MiB; 0: none)", "$MMIDX_CACHE_LIMIT, else no data cache"))


@contextlib.contextmanager
def cache_options(args: argparse.Namespace) -> Iterator[None]:
    """While a command runs: its ``--cache-dir`` and ``--cache-limit`` as ``MMIDX_CACHE_DIR`` and
    ``MMIDX_CACHE_LIMIT``, which every reader it opens (loader workers included) takes."""
    from mmidx.io.cache_folder import CACHE_DIR_VARIABLE, CACHE_LIMIT_VARIABLE

    folder, limit = getattr(args, "cache_dir", None), getattr(args, "cache_limit", None)
    given = {CACHE_DIR_VARIABLE: None if folder is None else os.path.abspath(folder),
             CACHE_LIMIT_VARIABLE: None if limit is None else str(limit)}
    given = {name: value for name, value in given.items() if value is not None}
    saved = {name: os.environ.get(name) for name in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def add_geometry_arguments(sub: argparse.ArgumentParser) -> None:
    """The model geometry options (:class:`mmidx.config.ModelGeometry`) of a command that lays out packs."""
    geometry = sub.add_argument_group(
        "model geometry", "the position grids of the model the packs feed (a data.yaml's geometry: key); by "
        "default a data.yaml's values, else BAGEL's raised to hold the largest image the transforms output")
    geometry.add_argument("--max-latent-size", type=at_least(1),
                          help="VAE latent grid side (BAGEL: 32 for 512-px images, 64 for 1024)")
    geometry.add_argument("--max-num-patch-per-side", type=at_least(1), help="ViT patch grid side (BAGEL: 70)")
    geometry.add_argument("--interpolate-pos", action="store_true", default=None,
                          help="interpolated position ids (BAGEL's --interpolate_pos): no grid limit")


def geometry_args(args: argparse.Namespace) -> dict[str, Any]:
    """The geometry fields given on the command line (see :func:`add_pack_arguments`)."""
    names = ("max_latent_size", "max_num_patch_per_side", "interpolate_pos")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


PREFIX_HELP = "dataset prefix (path without .idx/.bin; a path to one of its files is accepted too)"


PATHS_HELP = "dataset prefixes (paths or URIs: s3://bucket/prefix), or data YAMLs (every dataset of every group)"
