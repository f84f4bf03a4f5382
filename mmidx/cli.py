"""The ``mmidx`` command line: build, index, inspect, verify, show, demo.

Each subcommand is a small function taking the parsed arguments and returning an exit code;
``main`` only wires them to argparse.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mmidx import build
from mmidx.format import FormatError


def _human_bytes(size: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def _describe(stats: dict[str, float]) -> str:
    if not stats.get("count"):
        return "none"
    return (f"min {stats['min']:g}  mean {stats['mean']:g}  p50 {stats['p50']:g}  "
            f"p99 {stats['p99']:g}  max {stats['max']:g}")


def format_summary(info: dict[str, Any]) -> str:
    """The human-readable form of :func:`mmidx.checks.summary`."""
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
    files = ", ".join(f"{name} {_human_bytes(size)}" for name, size in info["files"].items())
    lines.append(f"  files            {files}")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    from mmidx.checks import summary
    from mmidx.dataset import MMIDXDataset

    info = summary(MMIDXDataset(args.prefix))
    print(json.dumps(info, indent=1) if args.json else format_summary(info))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from mmidx.checks import verify

    problems = verify(args.prefix)
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if problems:
        print(f"{args.prefix}: {len(problems)} problem(s) found", file=sys.stderr)
        return 1
    print(f"{args.prefix}: OK (checksums and structure verified)")
    return 0


Commands = Any  # the object argparse's add_subparsers returns


def add_command(commands: Commands, name: str, handler: Callable[[argparse.Namespace], int],
                help: str) -> argparse.ArgumentParser:
    """Register subcommand ``name``; modules that own a command call this from their ``register``."""
    sub = commands.add_parser(name, help=help, description=help)
    sub.set_defaults(handler=handler)
    return sub


def _register_inspect_and_verify(commands: Commands) -> None:
    sub = add_command(commands, "inspect", cmd_inspect,
                      "Print counts, size statistics, element kinds, images and file sizes.")
    sub.add_argument("prefix", help="dataset prefix (path without .idx/.bin)")
    sub.add_argument("--json", action="store_true", help="print machine-readable JSON")
    sub = add_command(commands, "verify", cmd_verify,
                      "Recompute checksums and structural invariants; exit 1 on any problem.")
    sub.add_argument("prefix", help="dataset prefix (path without .idx/.bin)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmidx", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    # Each module that owns a command registers it here (one line each).
    _register_inspect_and_verify(commands)
    build.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except FormatError as error:
        print(f"mmidx: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
