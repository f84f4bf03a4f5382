"""``mmidx cache``: what a node's cache of remote datasets holds (``info``), and emptying it (``clear``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from mmidx.cli.common import Commands, add_command, default_note, human_bytes


def format_info(info: dict[str, Any]) -> str:
    """The human-readable form of :func:`mmidx.io.cache_folder.cache_info`."""
    block = f", blocks of {info['block_size']:,} bytes" if info["block_size"] else " (no data cache there)"
    limit = f" of {human_bytes(info['limit'])} (the last run's limit)" if info["limit"] else ""
    lines = [f"mmidx data cache {info['folder']}: {human_bytes(info['bytes'])}{limit}{block}"]
    for uri, entry in sorted(info["datasets"].items()):
        versions = f"{entry['versions']} version{'s' * (entry['versions'] != 1)}"
        lines.append(f"  {uri}  {versions}, {entry['blocks']:,} blocks, {human_bytes(entry['bytes'])}")
    run = {name: info["run"].get(name, 0) for name in ("hits", "misses", "bytes_fetched", "bytes_from_cache",
                                                       "evicted", "bypassed", "dropped")}
    if info["run"]:
        reads = run["hits"] + run["misses"]
        rate = f" ({run['hits'] / reads:.1%} of block reads)" if reads else ""
        lines.append(f"  last run (started {info['run'].get('started', '?')}): hits {run['hits']:,}, misses "
                     f"{run['misses']:,}{rate}; fetched {human_bytes(run['bytes_fetched'])}, read from the cache "
                     f"{human_bytes(run['bytes_from_cache'])}; evicted {run['evicted']:,}, not stored "
                     f"{run['bypassed']:,}, bad entries dropped {run['dropped']:,}")
    lines.append(f"  remote datasets' small files: {human_bytes(info['small_files'])}")
    return "\n".join(lines)


def cmd_cache(args: argparse.Namespace) -> int:
    from mmidx.io.cache_admin import cache_info, clear_cache
    from mmidx.io.cache_folder import default_folder

    folder = default_folder(args.folder)
    if args.action == "info":
        if args.dataset:
            args.usage_error("--dataset is an option of `mmidx cache clear`")
        info = cache_info(folder)
        print(json.dumps(info, indent=1) if args.json else format_info(info))
        return 0
    freed = clear_cache(folder, args.dataset)
    print(f"{folder}: {human_bytes(freed)} freed ({'every cached block' if args.dataset is None else args.dataset})")
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
