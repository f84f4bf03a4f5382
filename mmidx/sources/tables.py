"""Tables of rows with named columns (URL lists): parquet, CSV, TSV or JSONL, each optionally gzipped.

A table is cut into work units of row ranges and read a piece at a time, never whole:

* parquet by row groups (:func:`mmidx.sources.inputs.parquet_units`; ``start``/``stop`` are row groups);
* CSV/TSV (a header line, then rows) and JSONL (one JSON object per non-blank line) are streamed in
  blocks through pyarrow's decompressing input streams; the planner counts their rows once, and a unit is
  the rows ``[start, stop)`` (``start``/``stop`` are row numbers, counted from 0 after the header).

Every CSV/TSV cell is read as a string (so a column's type never depends on which block is read);
an empty CSV cell is an empty string. Rows are dicts of the requested columns; a JSONL line that is not
a JSON object is a counted skip.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv

from mmidx.sources import Skip, SourceError, WorkUnit
from mmidx.sources.inputs import file_identity, filesystem, parquet_units, read_parquet

TABLE_EXTENSIONS = (".parquet", ".csv", ".tsv", ".jsonl", ".csv.gz", ".tsv.gz", ".jsonl.gz")
_BLOCK = 4 << 20


def _stream(location: str) -> Any:
    """A decompressing input stream of ``location`` (gzip when its name ends in ``.gz``)."""
    fs, path = filesystem(location)
    return fs.open_input_stream(path, compression="gzip" if location.endswith(".gz") else None)


def _delimiter(location: str) -> str:
    return "\t" if location.removesuffix(".gz").endswith(".tsv") else ","


def _csv_reader(location: str, columns: Sequence[str] | None) -> tuple[Any, Any]:
    """(stream, pyarrow CSV reader) of ``columns`` as strings (all columns when None)."""
    with _stream(location) as stream:
        names = pacsv.open_csv(stream, read_options=pacsv.ReadOptions(block_size=1 << 16),
                               parse_options=pacsv.ParseOptions(delimiter=_delimiter(location))).schema.names
    missing = [name for name in columns or () if name not in names]
    if missing:
        raise SourceError(f"{location}: no column {missing} (it has {names})")
    stream = _stream(location)
    convert = pacsv.ConvertOptions(column_types={name: pa.string() for name in names},
                                   include_columns=list(columns or names), strings_can_be_null=False)
    reader = pacsv.open_csv(stream, read_options=pacsv.ReadOptions(block_size=_BLOCK),
                            parse_options=pacsv.ParseOptions(delimiter=_delimiter(location), newlines_in_values=True),
                            convert_options=convert)
    return stream, reader


def _jsonl_lines(location: str) -> Iterator[bytes]:
    """The non-blank lines of a (possibly gzipped) JSONL file."""
    with _stream(location) as stream:
        pending = b""
        while chunk := stream.read(_BLOCK):
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            yield from (line for line in lines if line.strip())
        if pending.strip():
            yield pending


def count_rows(location: str) -> int:
    """The number of rows of a CSV/TSV/JSONL table (read once, block by block)."""
    if location.removesuffix(".gz").endswith(".jsonl"):
        return sum(1 for _ in _jsonl_lines(location))
    stream, reader = _csv_reader(location, None)
    with stream:
        return sum(batch.num_rows for batch in reader)


def table_units(paths: Sequence[str], rows_per_shard: int) -> list[WorkUnit]:
    """Row ranges of about ``rows_per_shard`` rows of every table (parquet: whole row groups)."""
    units = []
    for location in paths:
        if not location.endswith(TABLE_EXTENSIONS):
            raise SourceError(f"{location}: URL tables are {', '.join(TABLE_EXTENSIONS)} files")
        if location.endswith(".parquet"):
            units += parquet_units([location], rows_per_shard)
            continue
        identity, rows = file_identity(location), count_rows(location)
        units += [WorkUnit(location, start, min(start + rows_per_shard, rows), start,
                           min(start + rows_per_shard, rows) - start, identity)
                  for start in range(0, rows, rows_per_shard)] or [WorkUnit(location, 0, 0, 0, 0, identity)]
    return units


def read_table(unit: WorkUnit, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]] | Skip]:
    """(row, {column: value}) of every row of the unit, in order; unreadable parts as counted Skips."""
    if unit.path.endswith(".parquet"):
        yield from read_parquet(unit, columns)
    elif unit.path.removesuffix(".gz").endswith(".jsonl"):
        yield from _read_jsonl(unit, columns)
    else:
        yield from _read_csv(unit, columns)


def _read_jsonl(unit: WorkUnit, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]] | Skip]:
    for row, line in enumerate(_jsonl_lines(unit.path)):
        if row < unit.start:
            continue
        if unit.stop is not None and row >= unit.stop:
            return
        try:
            record = json.loads(line)
        except ValueError as error:
            yield Skip(row, "invalid_json", f"{error}: {line[:80]!r}")
            continue
        if not isinstance(record, dict):
            yield Skip(row, "malformed_record", f"a row is a JSON object, not {type(record).__name__}")
            continue
        yield row, {name: record.get(name) for name in columns}


def _read_csv(unit: WorkUnit, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    stream, reader = _csv_reader(unit.path, columns)
    row = 0
    with stream:
        for batch in reader:
            if unit.stop is not None and row >= unit.stop:
                return
            if row + batch.num_rows > unit.start:
                values = {name: batch.column(name).to_pylist() for name in columns}
                for i in range(max(0, unit.start - row), batch.num_rows):
                    if unit.stop is not None and row + i >= unit.stop:
                        return
                    yield row + i, {name: values[name][i] for name in columns}
            row += batch.num_rows
