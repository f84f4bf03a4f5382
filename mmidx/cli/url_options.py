"""The options of URL ingest (``mmidx build --source urls``: downloading while building), added to ``mmidx build``."""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_url_arguments(sub: argparse.ArgumentParser) -> None:
    """The URL-ingest options of ``mmidx build`` (they apply to --source urls; fetch options also to prompts)."""
    from mmidx.cli.common import at_least, default_note, size_note
    from mmidx.sources import SourceOptions

    defaults = SourceOptions()
    group = sub.add_argument_group("URL tables (--source urls)",
                                   "the fetch options also apply to http(s) images of --source prompts")
    group.add_argument("--url-column", default=defaults.url_column, metavar="COLUMN",
                       help="column of image URLs (LAION: URL)")
    group.add_argument("--fetch-concurrency", type=at_least(1), default=defaults.fetch_concurrency,
                       help="downloads in flight per work unit (Ray: per task)")
    group.add_argument("--per-host", type=at_least(1), default=defaults.per_host,
                       help="downloads in flight per host name, per work unit (Ray: per task)")
    group.add_argument("--timeout", type=at_least(0.001, float), default=defaults.fetch_timeout,
                       help="seconds for one whole try (connect, redirects, headers and body)")
    group.add_argument("--fetch-retries", type=at_least(0), default=defaults.fetch_retries,
                       help="tries after the first for transient failures (timeouts, resets, DNS, 429, 5xx)")
    group.add_argument("--max-image-bytes", type=at_least(1), default=defaults.max_image_bytes,
                       help=default_note("stop reading a body past this many bytes (fetch:too_large)",
                                         size_note(defaults.max_image_bytes, "bytes")))
    group.add_argument("--ignore-opt-out", action="store_true",
                       help="download images whose server says X-Robots-Tag noai/noimageai (each counted as a "
                            "warning in the report)")
    group.add_argument("--user-agent-token",
                       help="your crawl's name or contact, sent in the User-Agent after mmidx/VERSION")
    group.add_argument("--resolve", action="append", metavar="HOST=ADDRESS",
                       help="connect to ADDRESS for HOST instead of asking DNS (as curl's --resolve); repeatable")
    group.add_argument("--retry-failed", action="store_true",
                       help="rebuild --output from its earlier build's fetch ledger: rows that failed transiently "
                            "are fetched again, the others reused from the dataset or skipped as before")


def url_source_options(args: argparse.Namespace) -> dict[str, Any]:
    """The SourceOptions fields of the URL-ingest arguments."""
    return {"url_column": args.url_column, "fetch_concurrency": args.fetch_concurrency, "per_host": args.per_host,
            "fetch_timeout": args.timeout,
            "fetch_retries": args.fetch_retries, "max_image_bytes": args.max_image_bytes,
            "ignore_opt_out": args.ignore_opt_out, "user_agent_token": args.user_agent_token or "",
            "resolve": tuple(args.resolve or ()),
            "retry_failed": os.path.abspath(args.output) if args.retry_failed and args.output else None}


def max_skip_rate(args: argparse.Namespace) -> float:
    """--max-skip-rate as given, else the source's default (URL tables: 1.0, since downloads fail; else 0.01)."""
    from mmidx.sources import default_max_skip_rate

    if args.max_skip_rate is not None:
        return args.max_skip_rate
    return default_max_skip_rate(args.source) if args.source else 0.01
