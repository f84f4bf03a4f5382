"""Reading inputs: local paths or any pyarrow filesystem URI; parquet and JSONL cut into work units.

An input is a local path (``data/part-0.parquet``) or a URI pyarrow understands
(``file:///...``, ``s3://bucket/...``, ``gs://...``, ``hdfs://...``), through
``pyarrow.fs.FileSystem.from_uri``. A directory stands for the files in it with the source's
extensions, sorted by name.

* Parquet files are cut at row-group boundaries into units of at least ``rows_per_shard`` rows
  (a file with fewer rows is one unit). A row group that cannot be read skips its rows, counted.
* JSONL files larger than ``bytes_per_shard`` are cut into byte ranges that start at line starts;
  the planner counts the lines before each range, so row numbers are line numbers (from 0) in
  the file however it is cut. Blank lines are not rows (they keep their line number).
"""

from __future__ import annotations

import collections
import json
import os
import posixpath
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from mmidx.io import storage
from mmidx.sources import Skip, SourceError, WorkUnit

_READ_CHUNK = 8 << 20


def is_uri(location: str) -> bool:
    """Whether ``location`` names a filesystem by scheme (``s3://...``) rather than a local path."""
    return "://" in location


def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding an input and the path in it; pyarrow retries a failed request of a remote one."""
    return storage.filesystem(location, attempts=storage.RETRIES)


def _split_query(location: str) -> tuple[str, str]:
    """A URI without its query options (``?endpoint_override=...``), and the query with its ``?`` ("" if none)."""
    base, mark, query = location.partition("?")
    return base, mark + query


def _uri_of(location: str, path: str) -> str:
    """``path`` (a file directly inside the folder ``location`` names, in its filesystem) spelt the way
    ``location`` was: a URI with its query options, a relative folder as given (not made absolute, so reports
    name files as the user does)."""
    if is_uri(location):
        return f"{location.split('://', 1)[0]}://{quote(path)}{_split_query(location)[1]}"
    return os.path.join(location, posixpath.basename(path))


def list_inputs(inputs: Sequence[str], extensions: Sequence[str]) -> list[str]:
    """Expand directories into their files ending in ``extensions`` (sorted); check the rest exist."""
    files = []
    for location in inputs:
        fs, path = filesystem(location)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise SourceError(f"input {location!r} does not exist")
        if info.type == pafs.FileType.Directory:
            found = sorted(entry.path for entry in fs.get_file_info(pafs.FileSelector(path, recursive=False))
                           if entry.type == pafs.FileType.File and entry.path.endswith(tuple(extensions)))
            if not found:
                raise SourceError(_no_inputs_message(location, extensions, fs, path))
            files.extend(_uri_of(location, entry) for entry in found)
        else:
            files.append(location)
    return files


def _no_inputs_message(location: str, extensions: Sequence[str], fs: Any, path: str) -> str:
    """Why a folder gives a source no input: what it holds instead, and what builds such files."""
    held = collections.Counter(posixpath.splitext(entry.path)[1].lower() or "(no extension)"
                               for entry in fs.get_file_info(pafs.FileSelector(path, recursive=False))
                               if entry.type == pafs.FileType.File)
    holds = ", ".join(f"{count} {kind}" for kind, count in held.most_common(5)) or "no files"
    return (f"input directory {location!r} holds no {'/'.join(extensions)} files, the ones this source reads (it "
            f"holds {holds}; the input schema of each source: mmidx build --help). Images with a captions file, or "
            "any other layout, are built by mmidx.write from a Python function (help(mmidx.write), or the "
            "documentation's guide 'Your own data')")


def file_identity(location: str) -> str:
    """Size and modification time of a file: a rerun rebuilds shards of inputs that changed."""
    fs, path = filesystem(location)
    info = fs.get_file_info(path)
    mtime = info.mtime_ns if info.mtime_ns is not None else -1
    return f"{info.size}:{mtime}"


def read_bytes(location: str) -> bytes:
    """The whole content of a file (``FileNotFoundError`` if it does not exist)."""
    if not is_uri(location):
        with open(location, "rb") as stream:
            return stream.read()
    fs, path = filesystem(location)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        raise FileNotFoundError(location)
    with fs.open_input_stream(path) as stream:
        return stream.read()


def resolve(folder: str | None, name: str) -> str:
    """A file named in a row: absolute paths and URIs as they are, others relative to ``folder``."""
    if is_uri(name) or os.path.isabs(name) or folder is None:
        return name
    if not is_uri(folder):
        return os.path.join(folder, name)
    base, query = _split_query(folder)
    return posixpath.join(base, quote(name)) + query


def parent(location: str) -> str:
    """The folder holding ``location`` (a path or URI; a URI keeps its query options)."""
    if not is_uri(location):
        return os.path.dirname(os.path.abspath(location))
    base, query = _split_query(location)
    return posixpath.dirname(base) + query


# --------------------------------------------------------------------------- parquet


def parquet_units(paths: Sequence[str], rows_per_shard: int) -> list[WorkUnit]:
    """Row-group ranges of at least ``rows_per_shard`` rows; a file whose footer fails is one unit."""
    units = []
    for location in paths:
        identity = file_identity(location)
        fs, path = filesystem(location)
        try:
            with fs.open_input_file(path) as stream:
                metadata = pq.ParquetFile(stream).metadata
        except Exception:
            units.append(WorkUnit(location, identity=identity, line_based=True))
            continue
        start, first_row, rows = 0, 0, 0
        for group in range(metadata.num_row_groups):
            rows += metadata.row_group(group).num_rows
            if rows >= rows_per_shard or group == metadata.num_row_groups - 1:
                units.append(WorkUnit(location, start, group + 1, first_row, rows, identity))
                start, first_row, rows = group + 1, first_row + rows, 0
        if metadata.num_row_groups == 0:
            units.append(WorkUnit(location, 0, 0, 0, 0, identity))
    return units


def read_parquet(unit: WorkUnit, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]] | Skip]:
    """The unit's rows as dicts of ``columns``; unreadable row groups as one Skip per row."""
    fs, path = filesystem(unit.path)
    try:
        stream = fs.open_input_file(path)
        parquet = pq.ParquetFile(stream)
    except Exception as error:
        yield Skip(-1, "unreadable_file", f"cannot open parquet file: {error}")
        return
    with stream:
        missing = [name for name in columns if name not in parquet.schema_arrow.names]
        if missing:
            raise SourceError(f"{unit.path}: no column {missing} (it has {parquet.schema_arrow.names}); "
                              f"this source reads columns {list(columns)}")
        stop = parquet.metadata.num_row_groups if unit.stop is None else unit.stop
        row = unit.first_row
        for group in range(unit.start, stop):
            count = parquet.metadata.row_group(group).num_rows
            try:
                table = parquet.read_row_group(group, columns=list(columns))
            except Exception as error:
                detail = f"row group {group}: {error}"
                yield from (Skip(r, "unreadable_row_group", detail) for r in range(row, row + count))
                row += count
                continue
            values = {name: table.column(name).to_pylist() for name in columns}
            for i in range(table.num_rows):
                yield row + i, {name: values[name][i] for name in columns}
            row += count


# --------------------------------------------------------------------------- JSONL


def jsonl_units(paths: Sequence[str], bytes_per_shard: int) -> list[WorkUnit]:
    """Byte ranges of about ``bytes_per_shard`` bytes starting at line starts (small files: whole)."""
    units = []
    for location in paths:
        identity = file_identity(location)
        fs, path = filesystem(location)
        size = fs.get_file_info(path).size
        if size <= bytes_per_shard:
            units.append(WorkUnit(location, identity=identity, line_based=True))
            continue
        start, first_row, lines, position, target = 0, 0, 0, 0, bytes_per_shard
        with fs.open_input_stream(path) as stream:
            while chunk := stream.read(_READ_CHUNK):
                offset = 0
                while position + len(chunk) > target:
                    cut = chunk.find(b"\n", max(offset, target - position))
                    if cut < 0:
                        break
                    lines += chunk.count(b"\n", offset, cut + 1)
                    end = position + cut + 1
                    units.append(WorkUnit(location, start, end, first_row, None, identity, line_based=True))
                    start, first_row, offset = end, lines, cut + 1
                    target = end + bytes_per_shard
                lines += chunk.count(b"\n", offset)
                position += len(chunk)
        if start < size:
            units.append(WorkUnit(location, start, size, first_row, None, identity, line_based=True))
    return units


def read_lines(unit: WorkUnit) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for each non-blank line of the unit's byte range."""
    fs, path = filesystem(unit.path)
    row = unit.first_row
    with fs.open_input_file(path) as stream:
        stream.seek(unit.start)
        remaining = None if unit.stop is None else unit.stop - unit.start
        pending = b""
        while remaining is None or remaining > 0:
            chunk = stream.read(_READ_CHUNK if remaining is None else min(_READ_CHUNK, remaining))
            if not chunk:
                break
            if remaining is not None:
                remaining -= len(chunk)
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for line in lines:
                if line.strip():
                    yield row, line
                row += 1
        if pending.strip():
            yield row, pending


def read_jsonl(unit: WorkUnit) -> Iterator[tuple[int, Any] | Skip]:
    """(line number, parsed object) for each non-blank line; lines that are not JSON as Skips."""
    for row, line in read_lines(unit):
        try:
            yield row, json.loads(line)
        except ValueError as error:
            yield Skip(row, "invalid_json", f"{error}: {line[:80]!r}")
