"""The end of a large build: its finished shards become a sharded dataset (:mod:`mmidx.format`, version 2) by
writing a table and the metadata, never by copying a byte.

The shards stay where the build wrote them (``OUTPUT.shards/NNNNN/shard.*``); the table records, for each, its
folder number, its counts and its metadata's checksum, and ``OUTPUT.meta.json`` is written last, after the
table: until then nothing opens at ``OUTPUT``. What it costs is one read of each shard's metadata (a few KB),
whatever the shards hold. :func:`choose_layout` decides when a build ends this way rather than in one merged set
of files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx.ingest.writer import withdraw_dataset


def choose_layout(layout: str, shard_prefixes: list[str]) -> str:
    """"single" or "sharded" for a build asking ``layout`` over the finished shards at ``shard_prefixes``."""
    if layout not in fmt.BUILD_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(fmt.BUILD_LAYOUTS)}")
    if layout != "auto":
        return layout
    if len(shard_prefixes) > fmt.AUTO_SINGLE_UNITS:
        return "sharded"
    data = sum(fmt.file_path(prefix, role).stat().st_size for prefix in shard_prefixes for role in ("bin", "images")
               if fmt.file_path(prefix, role).exists())
    return "single" if data <= fmt.AUTO_SINGLE_BYTES else "sharded"


def write_sharded(output: str, numbers: list[int], build_config: dict[str, Any]) -> Path:
    """Make the finished shards numbered ``numbers`` (in order; each at ``fmt.shard_prefix(output, number)``) the
    sharded dataset at ``output``, recording ``build_config`` as its build. An old dataset there stops opening
    (its index and metadata removed) before the new table is put in place, and the metadata comes last."""
    metas = [fmt.read_metadata(fmt.file_path(fmt.shard_prefix(output, number), "meta")) for number in numbers]
    if not metas:
        raise ValueError("a sharded dataset needs at least one shard")
    first = metas[0]
    for number, meta in zip(numbers[1:], metas[1:], strict=True):
        for name in ("format_version", "kind", "token_dtype", "tokenizer", "special_tokens"):
            if fmt.canonical_json(meta.get(name)) != fmt.canonical_json(first.get(name)):
                raise ValueError(f"{fmt.shard_prefix(output, number)}: its {name} ({meta.get(name)!r}) is not that "
                                 f"of the first shard ({first.get(name)!r}); shards of one dataset share it")
    if first.get("layout", "single") != "single":
        raise ValueError(f"{fmt.shard_prefix(output, numbers[0])}: a shard is a dataset of one set of files")
    columns = fmt.KIND_COUNTS[first["kind"]]
    offsets = np.zeros((len(metas) + 1, len(columns)), dtype=np.int64)
    offsets[1:] = np.cumsum([[meta["counts"][name] for name in columns] for meta in metas], axis=0)
    table = fmt.file_path(output, "shards")
    partial = Path(f"{table}.partial")
    fmt.write_shard_table(partial, np.array(numbers, dtype=np.int64), offsets, [meta["meta_sha256"] for meta in metas])
    meta = {"format": fmt.FORMAT_NAME, "format_version": fmt.SHARDED_FORMAT_VERSION, "layout": "sharded",
            "kind": first["kind"], "token_dtype": first["token_dtype"], "shards": len(metas),
            "counts": dict(zip(columns, offsets[-1].tolist(), strict=True)), "tokenizer": first.get("tokenizer"),
            "special_tokens": first.get("special_tokens", {}), "build": build_config,
            "files": {"shards": {"name": table.name, "bytes": partial.stat().st_size,
                                 fmt.FILE_HASH: fmt.hash_file(partial)}}}
    meta_partial = Path(f"{fmt.file_path(output, 'meta')}.partial")
    fmt.write_metadata(meta_partial, meta)
    withdraw_dataset(output)
    os.replace(partial, table)
    os.replace(meta_partial, fmt.file_path(output, "meta"))
    for role in ("bin", "images", "plan"):  # an old single dataset's data, which no longer opens
        fmt.file_path(output, role).unlink(missing_ok=True)
    fmt.fsync_directory(Path(output).parent)
    return Path(output)


def is_sharded(output: str | os.PathLike) -> bool:
    """Whether ``output`` holds (the table of) a sharded dataset, which keeps its data in ``OUTPUT.shards``."""
    return fmt.file_path(output, "shards").exists()
