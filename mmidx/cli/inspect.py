"""``mmidx inspect``, ``verify`` and ``fetch``: what a dataset holds, whether its files are whole, a verified
local copy of one in object storage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from mmidx.cli.common import (
    PATHS_HELP,
    PREFIX_OR_DATA_YAML,
    Commands,
    _dataset_prefixes,
    add_cache_arguments,
    add_command,
    human_bytes,
    named_output,
)


def _number(value: float) -> str:
    """A statistic as the counts beside it are written: thousands separated, at most two decimals, none for a
    whole number (``2,023,090``, ``50.45``), never in exponent notation."""
    return f"{value:,.2f}".rstrip("0").rstrip(".")


def _describe(stats: dict[str, float]) -> str:
    if not stats.get("count"):
        return "none"
    return "  ".join(f"{name} {_number(stats[name])}" for name in ("min", "mean", "p50", "p99", "max"))


def format_summary(info: dict[str, Any]) -> str:
    """The human-readable form of :func:`mmidx.read.checks.summary`."""
    lines = [f"mmidx dataset {info['prefix']}  (format {info['format_version']}, {info['kind']}, "
             f"{info['token_dtype']} tokens, tokenizer {info['tokenizer'] or 'unrecorded'})"]
    counts = f"  samples {info['samples']:,}   sequences {info['sequences']:,}   tokens {info['tokens']:,}"
    if "views" in info:
        counts += f"   views {info['views']:,}   images {info['images']['count']:,}"
    lines += [counts,
              f"  tokens/sequence  {_describe(info['tokens_per_sequence'])}",
              f"  tokens/sample    {_describe(info['tokens_per_sample'])}"]
    if "views" in info:
        lines.append(f"  views/sample     {_describe(info['views_per_sample'])}")
        lines.append(f"  elements/view    {_describe(info['elements_per_view'])}")
        kinds = "  ".join(f"{name} {k['count']:,} (loss {k['loss']:,}, cfg {k['enable_cfg']:,})"
                          for name, k in info["element_kinds"].items())
        lines.append(f"  elements         {kinds}")
        images = info["images"]
        if images["count"]:
            formats = ", ".join(f"{name} {n:,}" for name, n in images["formats"].items())
            modes = ", ".join(f"{name} {n:,}" for name, n in images["modes"].items())
            lines += [f"  images           formats {formats};  modes {modes}",
                      f"  image width      {_describe(images['width'])}",
                      f"  image height     {_describe(images['height'])}",
                      f"  image bytes      {_describe(images['bytes'])}"]
    for enc in info.get("encodings", []):
        lines.append(f"  encoding {enc['name']:<7} {enc['records']:,} {enc['modality']} records ({enc['store']}, "
                     f"{enc['dtype']}, {human_bytes(enc['bytes'])}) of {enc['encoder']}")
    files = ", ".join(f"{name} {human_bytes(size)}" for name, size in info["files"].items())
    lines.append(f"  files            {files}")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    from mmidx.read.checks import summary
    from mmidx.read.dataset import MMIDXDataset

    infos = [summary(MMIDXDataset(prefix)) for prefix in _dataset_prefixes(args.paths)]
    if args.json:
        print(json.dumps(infos[0] if len(infos) == 1 else infos, indent=1))
    else:
        print("\n\n".join(format_summary(info) for info in infos))
    return 0


def _verify_one(prefix: str, decode: bool) -> bool:
    """Verify one dataset, print its verdict; True when it is sound."""
    from mmidx import format as fmt
    from mmidx.io.storage import is_remote
    from mmidx.read.checks import verify

    copies: list[str] = []
    try:
        problems = verify(prefix, decode=decode, copies=copies)
    except Exception as error:  # whatever the files hold: one line, never a traceback
        print(f"mmidx verify: {prefix}: verification stopped: {type(error).__name__}: {error}", file=sys.stderr)
        return False
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if len(problems) > 1:
        print(f"{prefix}: {len(problems)} problems found", file=sys.stderr)
    if problems:
        return False
    images = "every image decoded" if decode else "image headers probed"
    if not is_remote(prefix) and not fmt.file_path(prefix, "meta").exists():
        print(f"{prefix}: OK (structure only: a Megatron pair without mmidx metadata, so no checksum "
              "guards its bytes)")
    elif copies:  # a remote dataset: which copies the checksums were computed of
        from mmidx.io.cache_folder import cache_settings

        folder = os.path.dirname(copies[0])
        of = f"of this node's copies of the small files in {folder} and of the data's blocks in its cache (offline)" \
            if cache_settings().offline else f"of the objects in storage and of this node's copies of the small " \
            f"files in {folder}"
        print(f"{prefix}: OK (checksums and structure verified, {images}; the checksums {of})")
    else:
        print(f"{prefix}: OK (checksums and structure verified, {images})")
    return True


def cmd_verify(args: argparse.Namespace) -> int:
    results = [_verify_one(prefix, args.decode) for prefix in _dataset_prefixes(args.paths)]
    return 0 if all(results) else 1


def cmd_fetch(args: argparse.Namespace) -> int:
    """``mmidx fetch``: copy a dataset from object storage to local disk, then verify the copy."""
    from mmidx.io.small_files import fetch_dataset
    from mmidx.read.checks import verify

    folder = named_output(args, args.folder, "the folder as a last argument (mmidx fetch URI FOLDER)")
    local = fetch_dataset(args.uri, folder, force=args.force)
    problems = verify(local)
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"{local}: fetched from {args.uri} and verified (checksums and structure)")
    return 0


def _register_fetch(commands: Commands) -> None:
    sub = add_command(commands, "fetch", cmd_fetch,
                      "Copy a dataset from object storage (s3://bucket/prefix) into a local folder and verify it.")
    sub.add_argument("uri", metavar="URI", help="the dataset's prefix in object storage")
    sub.add_argument("-o", "--output", metavar="FOLDER", help="local folder; the copy keeps the prefix's last name")
    sub.add_argument("folder", nargs="?", help=argparse.SUPPRESS)  # deprecated: the folder, named with --output now
    sub.add_argument("--force", action="store_true",
                     help="replace another dataset of the same name in the folder (a copy of the same dataset is "
                          "fetched again without it)")
    add_cache_arguments(sub, limit=False)  # whole files are copied: no data block is cached


def _register_inspect_and_verify(commands: Commands) -> None:
    sub = add_command(commands, "inspect", cmd_inspect,
                      "Print counts, size statistics, element kinds, images and file sizes.")
    sub.add_argument("paths", nargs="+", metavar=PREFIX_OR_DATA_YAML, help=PATHS_HELP)
    sub.add_argument("--json", action="store_true",
                     help="print machine-readable JSON (one dataset: an object; several: a list)")
    add_cache_arguments(sub)
    sub = add_command(commands, "verify", cmd_verify,
                      "Recompute checksums and structural invariants, probe every image; exit 1 on any problem.")
    sub.add_argument("paths", nargs="+", metavar=PREFIX_OR_DATA_YAML, help=PATHS_HELP)
    sub.add_argument("--decode", action="store_true", help="also decode every stored image (slower)")
    add_cache_arguments(sub)


def register(commands: Commands) -> None:
    """Add this module's commands to the parser."""
    _register_inspect_and_verify(commands)
    _register_fetch(commands)
