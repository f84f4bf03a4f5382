"""The mmidx command line: one command per step from raw data to training (:data:`mmidx.cli.common.PIPELINE`).

Each subcommand is a small function taking the parsed arguments and returning an exit code;
``main`` wires them to argparse and turns any error that escapes them into one line and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import mmidx
from mmidx.cli import build, cache, index, inspect, precache, toolkit, view
from mmidx.cli.common import EXIT_STATUSES, PIPELINE, HelpFormatter, cache_options, in_pipeline_order
from mmidx.errors import MMIDXError, command_line

# What a rerun of an interrupted command does, where it keeps finished work.
RESUMES = {
    "build": "; rerun the same command to resume: the work units that finished are reused",
    "precache": "; rerun the same command to resume: the encodings already stored are kept",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmidx", description=f"The mmidx command line: {', '.join(PIPELINE)}.",
                                     epilog=EXIT_STATUSES, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"mmidx {mmidx.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for family in (inspect, cache, index, toolkit, build, precache, view):
        family.register(commands)
    in_pipeline_order(commands)
    return parser


def os_error_line(error: OSError) -> str:
    """An OSError as one line: the path and the cause (disk full, read-only, permission denied...)."""
    if error.filename is None:
        return str(error.strerror or error)
    return f"{error.filename}: {error.strerror or error}"


def _error_line(command: str, message: str) -> None:
    """The one line an error ends in, with the credentials of any URI it names hidden."""
    from mmidx.io.storage import redact

    print(f"{command}: {redact(message)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every error ends in one line on stderr and exit status 1 (2: usage)."""
    import yaml

    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    late = getattr(args, "late_positional", None)  # a deprecated argument that may follow the options
    if late is not None and getattr(args, late) is None and len(extras) == 1 and not extras[0].startswith("-"):
        setattr(args, late, extras.pop())  # argparse gave it up: an optional positional matches nothing first
    if extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    name = f"mmidx {args.command}"
    try:
        with command_line(), cache_options(args):  # messages name the options (--max-skip-rate), not parameters
            code = args.handler(args)
        sys.stdout.flush()  # a closed pipe is met here, not at exit where it could only be ignored noisily
        return code
    except BrokenPipeError:  # the reader went away (``| head``): nothing more to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted{RESUMES.get(args.command, '')}", file=sys.stderr)
        return 130
    except OSError as error:
        _error_line(name, os_error_line(error))
    except yaml.YAMLError as error:  # a malformed YAML file: its path and line are in the message
        _error_line(name, f"not valid YAML: {' '.join(str(error).split())}")
    except (MMIDXError, ValueError, KeyError, TypeError) as error:  # bad input or configuration: what, not where
        _error_line(name, str(error))
    except Exception as error:  # a bug: still one line, and how to see the rest
        if os.environ.get("MMIDX_TRACEBACK"):
            raise
        _error_line(name, f"internal error {type(error).__name__}: {error} (set MMIDX_TRACEBACK=1 for the traceback)")
    return 1
