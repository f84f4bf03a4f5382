"""The fetch ledger: one parquet row per input row of a URL build, ``PREFIX.fetch.parquet`` beside the dataset.

Columns: ``file`` and ``row`` (where the row is), ``url``, ``class`` (``ok``, a fetch outcome class, or the
skip reason of a row that was never fetched, e.g. ``bad_captions``), ``status`` (the last HTTP status,
null if none), ``bytes`` and ``sha256`` (of the body as served, when one was received), ``attempts`` and
``detail``. Each work unit writes its part (``fetch.parquet`` in its shard folder, published with the
shard); the build concatenates the parts in unit order, so the ledger is in input order like the samples.
``mmidx build --retry-failed`` reads it to fetch again only the rows whose class is transient.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmidx.io.files import remove_stale_partials

PART_NAME = "fetch.parquet"
SCHEMA = pa.schema([("file", pa.string()), ("row", pa.int64()), ("url", pa.string()), ("class", pa.string()),
                    ("status", pa.int32()), ("bytes", pa.int64()), ("sha256", pa.string()),
                    ("attempts", pa.int32()), ("detail", pa.string())])
_BATCH = 4096


def ledger_path(prefix: str | os.PathLike) -> Path:
    """Where the fetch ledger of the dataset ``prefix`` lives."""
    return Path(os.fspath(prefix) + ".fetch.parquet")


class LedgerWriter:
    """Appends ledger rows to ``folder/fetch.parquet`` in batches (memory bounded by one batch)."""

    def __init__(self, folder: str | os.PathLike):
        self.path = Path(folder, PART_NAME)
        self._rows: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(self.path, SCHEMA)

    def add(self, file: str, row: int, url: str | None, outcome: str, status: int | None = None,
            size: int | None = None, sha256: str | None = None, attempts: int = 0, detail: str = "") -> None:
        self._rows.append({"file": file, "row": row, "url": url, "class": outcome, "status": status, "bytes": size,
                           "sha256": sha256, "attempts": attempts, "detail": detail[:500]})
        if len(self._rows) >= _BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=SCHEMA))
            self._rows = []

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:
            self._flush()
        self._writer.close()


def merge_ledgers(shard_folders: Sequence[str | os.PathLike], output: str | os.PathLike) -> None:
    """Concatenate the ledger parts of ``shard_folders`` (in order) into ``output``'s ledger, atomically.

    Without any part (a build of another source) a stale ledger at ``output`` is removed.
    """
    parts = [Path(folder, PART_NAME) for folder in shard_folders if Path(folder, PART_NAME).exists()]
    target = ledger_path(output)
    remove_stale_partials(target, exclusive=True)  # a build killed while merging (we hold the output's lock)
    if not parts:
        target.unlink(missing_ok=True)
        return
    temporary = target.with_name(f"{target.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        with pq.ParquetWriter(temporary, SCHEMA) as writer:
            for part in parts:
                source = pq.ParquetFile(part)
                for group in range(source.num_row_groups):
                    writer.write_table(source.read_row_group(group))
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_ledger(prefix: str | os.PathLike, file: str, first_row: int, stop_row: int | None) -> dict[int, dict]:
    """The ledger rows of ``file`` with ``first_row <= row < stop_row``, by row ({} without a ledger)."""
    path = ledger_path(prefix)
    if not path.exists():
        return {}
    table = pq.read_table(path, filters=[("file", "=", file), ("row", ">=", first_row)]
                          + ([("row", "<", stop_row)] if stop_row is not None else []))
    return {entry["row"]: entry for entry in table.to_pylist()}
