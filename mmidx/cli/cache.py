"""``mmidx cache``: what a node's cache of remote datasets holds (``info``), and emptying it (``clear``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from mmidx.cli.common import Commands, add_command, default_note


def _bytes(size: float | None) -> str:
    if size is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def format_info(info: dict[str, Any]) -> str:
    """The human-readable form of :func:`mmidx.io.cache_folder.cache_info`."""
    block = f", blocks of {info['block_size']:,} bytes" if info["block_size"] else " (no data cache there)"
    limit = f" of {_bytes(info['limit'])} (the last run's limit)" if info["limit"] else ""
    lines = [f"mmidx data cache {info['folder']}: {_bytes(info['bytes'])}{limit}{block}"]
    for uri, entry in sorted(info["datasets"].items()):
        versions = f"{entry['versions']} version{'s' * (entry['versions'] != 1)}"
        lines.append(f"  {uri}  {versions}, {entry['blocks']:,} blocks, {_bytes(entry['bytes'])}")
    run = info["run"]
    if run:
        reads = run.get("hits", 0) + run.get("misses", 0)
        rate = f" ({run.get('hits', 0) / reads:.1%} of block reads)" if reads else ""
        lines.append(f"  last run (started {run.get('started', '?')}): hits {run.get('hits', 0):,}, misses "
                     f"{run.get('misses', 0):,}{rate}; fetched {_bytes(run.get('bytes_fetched', 0))}, read from the "
                     f"cache {_bytes(run.get('bytes_from_cache', 0))}; evicted {run.get('evicted', 0):,}, not stored "
                     f"{run.get('bypassed', 0):,}, bad entries dropped {run.get('dropped', 0):,}")
    lines.append(f"  remote datasets' small files: {_bytes(info['small_files'])}")
    return "\n".join(lines)


def cmd_cache(args: argparse.Namespace) -> int:
    from mmidx.io.cache_folder import cache_info, clear_cache, default_folder

    folder = default_folder(args.folder)
    if args.action == "info":
        if args.dataset:
            args.usage_error("--dataset is an option of `mmidx cache clear`")
        info = cache_info(folder)
        print(json.dumps(info, indent=1) if args.json else format_info(info))
        return 0
    freed = clear_cache(folder, args.dataset)
    print(f"{folder}: {_bytes(freed)} freed ({'every cached block' if args.dataset is None else args.dataset})")
    return 0


def register(commands: Commands) -> None:
    """Add ``mmidx cache`` to the command line's subcommands."""
    sub = add_command(commands, "cache", cmd_cache,
                      "What the cache of remote datasets on this node holds (info: size, limit, datasets, the last "
                      "run's hits, misses and bytes fetched), or empty it (clear).")
    sub.add_argument("action", choices=("info", "clear"), help="info: print what the cache holds; clear: delete "
                     "its data blocks and small files (mmidx's own files only), all or one dataset's")
    sub.add_argument("folder", nargs="?", metavar="DIR", help=default_note(
        "mmidx's cache folder (as --cache-dir)", "$MMIDX_CACHE_DIR, else ~/.cache/mmidx"))
    sub.add_argument("--dataset", metavar="URI", help="clear: only this dataset's blocks and files (every version)")
    sub.add_argument("--json", action="store_true", help="info: print machine-readable JSON")
