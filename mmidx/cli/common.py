"""What every command module of the CLI shares: argument conventions, help formatting and registration.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mmidx.errors import MMIDXError
from mmidx.format import SUFFIXES, FormatError, holds_dataset

EXIT_STATUSES = """exit status: 0 success; 1 failure (bad or missing file, bad data, a problem found), reported in
one line naming the path and the cause; 2 usage error (unknown option, bad value)."""


def dataset_prefix(value: str) -> str:
    """A dataset prefix as the user may give it: ``ds/t2i``, or one of its files (``ds/t2i.idx``,
    ``ds/t2i.bin``, ``ds/t2i.meta.json``...). A suffix is kept when it is part of a prefix whose
    files exist (``x.bin`` with ``x.bin.idx`` beside it). A ``file://`` URI is the local path it names."""
    from mmidx.io.storage import local_path

    value = local_path(value)
    for suffix in SUFFIXES.values():
        if value.endswith(suffix) and not os.path.exists(value + SUFFIXES["idx"]):
            return value.removesuffix(suffix)
    return value


def output_prefix(value: str) -> str:
    """An output dataset prefix (as :func:`dataset_prefix` reads it), or a usage error when it names a folder
    (``out/``: its files would be hidden, ``out/.idx``...)."""
    from mmidx.errors import command_line
    from mmidx.format import PrefixError
    from mmidx.format import output_prefix as checked

    try:
        with command_line():  # arguments are parsed before the command runs in this context
            return checked(dataset_prefix(value))
    except PrefixError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def named_output(args: argparse.Namespace, positional: str | None, old_form: str) -> str:
    """The output a command names with ``-o/--output``; the deprecated form that gave it as an argument
    (``positional``, spelled ``old_form`` in the line that says so) still works, with one warning on stderr."""
    if args.output is not None and positional is not None:
        args.usage_error(f"give the output once, as --output {args.output} (not also as {positional!r})")
    if args.output is not None:
        return args.output
    if positional is None:
        args.usage_error("give the output as -o/--output")
    print(f"mmidx {args.command}: warning: {old_form} is deprecated and will be removed; name the output with "
          f"-o/--output {positional}", file=sys.stderr)
    return positional


def one_dataset(value: str) -> str:
    """An argparse type: the prefix of one dataset (:func:`dataset_prefix`), where a data YAML cannot stand for
    it (``sample``, ``export``, ``merge``); a YAML file is a usage error naming the datasets a data YAML lists."""
    if value.endswith((".yaml", ".yml")) and os.path.isfile(value) and not os.path.exists(value + SUFFIXES["idx"]):
        raise argparse.ArgumentTypeError(_one_dataset_expected(value))
    return dataset_prefix(value)


def _is_folder(prefix: str) -> bool:
    """Whether ``prefix`` is a local folder rather than a dataset (no dataset's files beside it)."""
    return os.path.isdir(prefix) and not holds_dataset(prefix)


FOLDER_SCAN = 10_000  # entries of a folder named for a dataset looked through for the datasets in it


def datasets_in(folder: str) -> list[str]:
    """The prefixes of the datasets in ``folder`` and its subfolders (those with an index or metadata; not the
    precached encodings beside them), sorted, among its first :data:`FOLDER_SCAN` entries."""
    found: set[str] = set()
    seen = 0
    for root, folders, files in os.walk(folder):
        folders.sort()
        for name in files:
            for suffix in (SUFFIXES["idx"], SUFFIXES["meta"]):
                if name.endswith(suffix) and name != suffix:
                    found.add(os.path.join(root, name.removesuffix(suffix)))
        seen += len(folders) + len(files)
        if seen >= FOLDER_SCAN:
            break
    encodings = {prefix for prefix in found if ".enc." in os.path.basename(prefix)
                 and prefix.rpartition(".enc.")[0] in found}  # P.enc.NAME.idx beside P's own files
    return sorted(found - encodings)


def _folder_named(folder: str) -> str:
    """Why a folder cannot stand where a dataset prefix is expected, naming the datasets in it (and its data
    YAMLs), as the user named the folder."""
    prefixes = datasets_in(folder)
    yamls = sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith((".yaml", ".yml")))
    if not prefixes:
        return (f"{folder} is a folder with no dataset in it; give a dataset's prefix (its files are PREFIX.idx, "
                "PREFIX.bin...)")
    shown = ", ".join(prefixes[:8]) + (f" ... ({len(prefixes)} in all)" if len(prefixes) > 8 else "")
    also = f" (or a data YAML: {', '.join(yamls[:4])})" if yamls else ""
    return f"{folder} is a folder, not a dataset; give one of the datasets in it: {shown}{also}"


def _one_dataset_expected(path: str) -> str:
    """Why a YAML file cannot stand where one dataset prefix is expected, naming the datasets a data YAML lists."""
    import yaml

    try:
        prefixes = _dataset_prefixes([path])
    except (MMIDXError, OSError, ValueError, yaml.YAMLError):  # not a data YAML (a BAGEL config, a typo)
        return f"{path} is a YAML file, not a dataset; give one dataset's prefix (the path without .idx/.bin)"
    if not os.path.isabs(path):  # named as the user named the YAML: relative to here
        prefixes = [prefix if "://" in prefix else os.path.relpath(prefix) for prefix in prefixes]
    shown = ", ".join(prefixes[:8]) + (f" ... ({len(prefixes)} in all)" if len(prefixes) > 8 else "")
    return f"{path} is a data YAML, not one dataset; give one of its datasets' prefixes: {shown}"


def _dataset_prefixes(paths: Sequence[str]) -> list[str]:
    """The datasets named on the command line: prefixes as given, or every dataset of each data YAML; a folder is
    an error naming the datasets in it."""
    from mmidx.config import DataConfig, is_data_yaml

    prefixes = []
    for path in paths:
        if is_data_yaml(path):
            config = DataConfig.from_yaml(path)
            prefixes += [prefix for group in config.groups for prefix in group.datasets]
        elif _is_folder(prefix := dataset_prefix(path)):
            raise FormatError(_folder_named(prefix))
        else:
            prefixes.append(prefix)
    return prefixes


Commands = Any  # the object argparse's add_subparsers returns


# How help names an argument: the same words for the same thing in every command.
PREFIX = "PREFIX"  # one dataset prefix (path without .idx/.bin)
PREFIX_OR_DATA_YAML = "PREFIX_OR_DATA_YAML"  # dataset prefixes, or a data.yaml naming them

# The order ``mmidx --help`` lists the commands in: the pipeline's, from raw data to training.
PIPELINE = ("build", "merge", "inspect", "verify", "sample", "export", "fetch", "cache", "precache", "index", "show",
            "bench", "view", "demo")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The help of every command: a short usage line, paragraphs wrapped at the terminal's width (at most 100
    columns), and every option's help ending in argparse's ``(default: …)``, unless it has none (None, False) or
    says it already.

    The usage line names the required options and the positional arguments, and ``[options]`` for the rest
    (listed below it), so a usage error is two lines, not argparse's list of every option. Help that must say
    more than a value (``None`` meaning "the source's choice", a size) writes its default the same way:
    ``(default: …)`` at the end, as :func:`default_note` does. A paragraph whose every line is indented (a
    table) is kept as written."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        kwargs.setdefault("width", max(40, min(shutil.get_terminal_size().columns - 2, 100)))
        super().__init__(prog, **kwargs)

    def add_usage(self, usage: str | None, actions: Any, groups: Any, prefix: str | None = None) -> None:
        if usage is None:
            parts = ["%(prog)s"]
            parts += [f"{action.option_strings[0]} {self._format_args(action, action.dest.upper())}"
                      for action in actions if action.option_strings and action.required]
            if any(action.option_strings and not action.required for action in actions):
                parts.append("[options]")
            parts += [self._format_args(action, action.dest) for action in actions
                      if not action.option_strings and action.help != argparse.SUPPRESS]  # not a deprecated form
            usage = " ".join(parts)
        super().add_usage(usage, actions, groups, prefix)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Each paragraph (blank-line separated) wrapped on its own, unless every line of it is indented."""
        return "\n\n".join(
            paragraph if all(line.startswith(" ") for line in paragraph.splitlines())
            else super(HelpFormatter, self)._fill_text(paragraph, width, indent) for paragraph in text.split("\n\n"))

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == () or "(default: " in (
                action.help or ""):
            return action.help or ""
        if isinstance(action.default, int) and not isinstance(action.default, bool) and action.default >= 10_000:
            return default_note(action.help or "", f"{action.default:,}")  # as the commands print counts: 20,000
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


def size_note(value: int, unit: str) -> str:
    """A size default as every help text writes one: a readable form, then the exact number the option takes
    with its unit: "256 MiB = 268,435,456 bytes" (bytes in whole MiB), "2^27 = 134,217,728 pixels" (another
    power of two), else "100,000 rows"."""
    if unit == "bytes" and value and value % (1 << 20) == 0:
        readable = f"{value >> 20:,} MiB"
    elif value and value & (value - 1) == 0:
        readable = f"2^{value.bit_length() - 1}"
    else:
        return f"{value:,} {unit}"
    return f"{readable} = {value:,} {unit}"


def fraction(text: str) -> float:
    """An argparse type: a fraction in [0, 1], or a usage error (exit 2) saying so."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1] (0.05: 5% of the rows)")
    return value


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
    """``--cache-dir``, ``--cache-limit`` and ``--cache-offline`` of every command that reads datasets
    (:func:`cache_options` applies them to every reader of the command, as ``MMIDX_CACHE_DIR``,
    ``MMIDX_CACHE_LIMIT`` and ``MMIDX_CACHE_OFFLINE`` do); ``indices``: the command caches the indices it builds
    there too; ``limit``: it reads data by byte range (not whole files)."""
    what = "mmidx's cache folder: remote datasets' small files" + (" and, with --cache-limit, data blocks" * limit)
    sub.add_argument("--cache-dir", metavar="DIR", help=default_note(
        what + ("; the indices built are cached there too" if indices else ""),
        "$MMIDX_CACHE_DIR, else ~/.cache/mmidx" + ("; indices built in memory" if indices else "")))
    if limit:
        sub.add_argument("--cache-limit", type=_size, metavar="BYTES", help=default_note(
            "turn on the data cache of remote datasets: the bytes it may take on this node, shared by its processes "
            "(500G, 1.5T, 64MiB; 0: none)", "$MMIDX_CACHE_LIMIT, else no data cache"))
        sub.add_argument("--cache-offline", action="store_true", default=None, help=default_note(
            "open remote datasets from this node's cache alone, never asking the store (every block must be cached)",
            "$MMIDX_CACHE_OFFLINE=1, else off"))


@contextlib.contextmanager
def cache_options(args: argparse.Namespace) -> Iterator[None]:
    """While a command runs: its ``--cache-dir``, ``--cache-limit`` and ``--cache-offline`` as ``MMIDX_CACHE_DIR``,
    ``MMIDX_CACHE_LIMIT`` and ``MMIDX_CACHE_OFFLINE``, which every reader it opens (loader workers included) takes."""
    from mmidx.io.cache_folder import CACHE_DIR_VARIABLE, CACHE_LIMIT_VARIABLE, CACHE_OFFLINE_VARIABLE

    folder, limit = getattr(args, "cache_dir", None), getattr(args, "cache_limit", None)
    given = {CACHE_DIR_VARIABLE: None if folder is None else os.path.abspath(folder),
             CACHE_LIMIT_VARIABLE: None if limit is None else str(limit),
             CACHE_OFFLINE_VARIABLE: "1" if getattr(args, "cache_offline", None) else None}
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
