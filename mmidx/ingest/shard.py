"""Build one work unit into its shard, under a name of its own attempt, and publish it by one rename.

An attempt writes the complete shard — ``shard.*`` dataset files, then ``report.json`` — into
``NNNNN.attempt-PID-RANDOM/`` beside the final folder, then renames that folder to ``NNNNN/``.
The rename is the publication: a reader sees either no shard or a whole one with its report, so a
retried, duplicated or killed attempt (Ray retries tasks, nodes may overlap) never leaves a mixed
shard. If another attempt of the same unit published first, its shard is kept (builds are
deterministic, so both hold the same bytes) and this attempt's copy is deleted.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mmidx import format as fmt
from mmidx.ingest.plan import BuildError, BuildOptions, BuildPlan, finished_shard, meta_sha256, shard_dir, shard_prefix
from mmidx.ingest.report import count_skip, count_warning, new_counts
from mmidx.ingest.writer import DatasetBuilder
from mmidx.io.files import write_json
from mmidx.sources import Skip, SourceContext, SourceDocument, SourceSample, get_source
from mmidx.sources.chat_config import special_token_texts
from mmidx.tokenizer import Tokenizer

PROGRESS_INTERVAL = 0.5  # seconds between progress messages of a unit
ATTEMPT_MARK = ".attempt-"

Progress = Callable[[int, int, int, int], None]  # (rows, images, tokens, image bytes) since the last call

_tokenizers: dict[tuple[str, tuple[str, ...]], Tokenizer] = {}


def load_tokenizer(name: str, fresh: bool = False, added_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """The tokenizer ``name`` with ``added_tokens``, loaded once per process (``fresh``: read again, as a new
    build does)."""
    key = (name, added_tokens)
    if fresh or key not in _tokenizers:
        _tokenizers[key] = Tokenizer(name, added_tokens)
    return _tokenizers[key]


def build_tokenizer(options: BuildOptions, fresh: bool = False) -> Tokenizer:
    """The tokenizer a build's options name, with the special tokens its chat config adds."""
    added = special_token_texts(options.source_options.chat_config)
    return load_tokenizer(options.tokenizer, fresh, added)


def tokenizer_for(plan: BuildPlan) -> Tokenizer:
    """The plan's tokenizer in this process (forked workers inherit the driver's; others load it once)."""
    tokenizer = build_tokenizer(plan.options)
    if tokenizer.identity != plan.config["tokenizer"]:
        raise BuildError(f"the tokenizer {plan.options.tokenizer!r} on this machine ({os.uname().nodename}) differs "
                         "from the one the build was planned with; every node must see the same tokenizer files")
    return tokenizer


def _bounded(item: SourceSample | SourceDocument, limit: int) -> SourceSample | SourceDocument | Skip:
    """``item``, or a ``text_too_long`` skip when one of its texts has more than ``limit`` tokens (so no single
    row, e.g. a web caption of a million tokens, can take a viewer or a loader down)."""
    lengths = [len(item.tokens)] if isinstance(item, SourceDocument) else [len(text) for text in item.texts]
    longest = max(lengths, default=0)
    if longest <= limit:
        return item
    return Skip(item.row, "text_too_long", f"a text of {longest:,} tokens, more than --max-text-tokens {limit:,}")


def _write_shard(plan: BuildPlan, index: int, folder: Path, tokenizer: Tokenizer, progress: Progress) -> dict[str, Any]:
    """Build unit ``index`` into the dataset ``folder/shard`` and write ``folder/report.json``."""
    unit = plan.units[index]
    source = get_source(plan.options.source)
    context = SourceContext(tokenizer, plan.options.source_options, side_folder=os.fspath(folder))
    counts = new_counts()
    started = last = time.perf_counter()
    pending = [0, 0, 0, 0]  # rows, images, tokens, image bytes not yet reported
    prefix = shard_prefix(folder)
    with DatasetBuilder(prefix, kind=source.KIND, vocab_size=tokenizer.vocab_size, tokenizer=tokenizer.identity,
                        special_tokens=tokenizer.special_tokens, build_config=plan.config,
                        check_images=False) as builder:  # the source checked each image (ingest_image)
        origin = builder.source_id(unit.path)
        for item in source.read(unit, context):
            counts["rows"] += 1
            pending[0] += 1
            if not isinstance(item, Skip):
                item = _bounded(item, plan.options.source_options.max_text_tokens)
            if isinstance(item, Skip):
                count_skip(counts, item, unit.path, unit.line_based)
            else:
                with context.timed("write"):
                    if isinstance(item, SourceDocument):
                        builder.add_document([item.tokens])
                        tokens, images, views = len(item.tokens), 0, 1
                    else:
                        builder.add_sample(item.texts, item.images, item.views, (origin, item.row), item.extra)
                        pending[3] += sum(len(image.data) for image in item.images)
                        tokens, images, views = sum(map(len, item.texts)), len(item.images), len(item.views)
                        for reason, detail in item.warnings:
                            count_warning(counts, reason, item.row, detail, unit.path, unit.line_based)
                counts["samples"] += 1
                counts["views"] += views
                counts["images"] += images
                counts["tokens"] += tokens
                pending[1] += images
                pending[2] += tokens
            now = time.perf_counter()
            if now - last > PROGRESS_INTERVAL:
                progress(*pending)
                pending, last = [0, 0, 0, 0], now
        with context.timed("write"):
            builder.finalize()
    progress(*pending)
    counts["seconds"] = {**context.seconds, "total": time.perf_counter() - started}
    report = {"key": plan.unit_key(index), "index": index, "unit": asdict(unit), "meta_sha256": meta_sha256(prefix),
              **counts}
    write_json(folder / "report.json", report)
    return report


def build_unit(plan: BuildPlan, index: int, tokenizer: Tokenizer, progress: Progress) -> dict[str, Any]:
    """Build unit ``index`` of ``plan`` into its shard folder and return the shard's report."""
    final = shard_dir(plan.shards, index)
    staging = final.with_name(f"{final.name}{ATTEMPT_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    staging.mkdir(parents=True)
    try:
        report = _write_shard(plan, index, staging, tokenizer, progress)
        fmt.fsync_directory(staging)
        try:
            os.rename(staging, final)
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            published = finished_shard(final, report["key"])  # another attempt of this unit was first
            if published is None:
                raise BuildError(f"{final} exists and is not this unit's shard: is another build writing "
                                 f"{plan.shards}?") from error
            return published
        fmt.fsync_directory(final.parent)
        return report
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def clear_unit(plan: BuildPlan, index: int) -> None:
    """Delete whatever an earlier run left of unit ``index`` (a stale shard, attempts that were killed)."""
    final = shard_dir(plan.shards, index)
    for leftover in [final, *final.parent.glob(f"{final.name}{ATTEMPT_MARK}*")]:
        shutil.rmtree(leftover, ignore_errors=True)
