"""The mmidx command line: build, merge, index, inspect, verify, fetch, show, bench, sample, export, demo.

Each subcommand is a small function taking the parsed arguments and returning an exit code;
``main`` wires them to argparse and turns any error that escapes them into one line and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import mmidx
from mmidx.cli import build, index, inspect, precache, toolkit
from mmidx.cli.common import EXIT_STATUSES, HelpFormatter
from mmidx.errors import MMIDXError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmidx", description=__doc__.splitlines()[0], epilog=EXIT_STATUSES,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"mmidx {mmidx.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for family in (inspect, index, toolkit, build, precache):
        family.register(commands)
    return parser


def os_error_line(error: OSError) -> str:
    """An OSError as one line: the path and the cause (disk full, read-only, permission denied...)."""
    if error.filename is None:
        return str(error.strerror or error)
    return f"{error.filename}: {error.strerror or error}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every error ends in one line on stderr and exit status 1 (2: usage)."""
    import yaml

    args = build_parser().parse_args(argv)
    name = f"mmidx {args.command}"
    try:
        code = args.handler(args)
        sys.stdout.flush()  # a closed pipe is met here, not at exit where it could only be ignored noisily
        return code
    except BrokenPipeError:  # the reader went away (``| head``): nothing more to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except OSError as error:
        print(f"{name}: {os_error_line(error)}", file=sys.stderr)
    except yaml.YAMLError as error:  # a malformed YAML file: its path and line are in the message
        print(f"{name}: not valid YAML: {' '.join(str(error).split())}", file=sys.stderr)
    except (MMIDXError, ValueError, KeyError, TypeError) as error:  # bad input or configuration: what, not where
        print(f"{name}: {error}", file=sys.stderr)
    except Exception as error:  # a bug: still one line, and how to see the rest
        if os.environ.get("MMIDX_TRACEBACK"):
            raise
        print(f"{name}: internal error {type(error).__name__}: {error} (set MMIDX_TRACEBACK=1 for the traceback)",
              file=sys.stderr)
    return 1
