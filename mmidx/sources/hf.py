"""``hf``: Hugging Face ``datasets`` on disk — a ``Dataset.save_to_disk`` folder or parquet files in the hub layout.

Input (``--input PATH``, local or a pyarrow URI):

* a folder written by ``Dataset.save_to_disk`` (``state.json`` names its Arrow files, read in that order);
* a folder written by ``DatasetDict.save_to_disk`` (``dataset_dict.json``): ``--split`` picks the split
  (needed when there are several);
* a parquet or Arrow file, or a folder of them (searched recursively, sorted by relative path): the hub's
  layout (``data/train-00000-of-00002.parquet``, ``train/0000.parquet``). ``--split NAME`` keeps the files
  with a folder named NAME on their path or whose name starts with ``NAME-``, ``NAME_`` or ``NAME.``;
  without it every file is read.

``datasets`` itself is not needed: the files are read with pyarrow, parquet by row group (units of at least
``--rows-per-shard`` rows) and Arrow by record batch (a file per unit). Columns:

* ``--image-column`` (default ``image``, else ``images``): an ``Image`` feature (a struct of ``bytes`` and
  ``path``; a row without bytes reads ``path``, resolved against ``--image-root`` or the table's folder),
  plain bytes, or a file name; for conversation rows a list of them.
* ``--caption-column`` (one or several, comma-separated; default the first of ``captions``, ``caption``,
  ``text``, ``texts`` the table has): each cell a string, a list of strings, a struct of strings, or a string
  holding BAGEL's t2i JSON object of strings (``{"0": "a cat", ...}``, parsed: its values are the captions,
  never the JSON text); the captions of all the columns, in order, are the row's caption dict (BAGEL's
  ``{"0": ..., "1": ...}``).
* ``--keep-columns``: stored as each sample's extra JSON (``Sample.extra``), written back by
  ``mmidx export --to hf``; they must hold JSON values (strings, numbers, booleans, lists, structs).

Rows are t2i-shaped (built exactly as :mod:`mmidx.sources.t2i` builds a row: every distinct caption once,
K views drawing captions) unless the table has a ``conversations`` column (LLaVA's list of
``{"from", "value"}``): those rows are built as :mod:`mmidx.sources.vlm` builds an image row, over the
images of the image column (none, or no image column: a text-only conversation). Row numbers and draws are
the file's, as for every source: ``(seed, file name, row)``.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from mmidx.sources import Skip, Skipped, SourceContext, SourceError, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.common import caption_sample, conversation_turns, samples_of
from mmidx.sources.elements import StoredImage
from mmidx.sources.inputs import file_identity, filesystem, parent, parquet_units, read_parquet, resolve
from mmidx.sources.media import ingest_image, ingest_image_file
from mmidx.sources.vlm import image_conversation

KIND = "multimodal"
EXTENSIONS = (".parquet", ".arrow")
IMAGE_COLUMNS = ("image", "images")
CAPTION_COLUMNS = ("captions", "caption", "text", "texts")


# --------------------------------------------------------------------------- files


def _read_json(fs: pafs.FileSystem, path: str) -> dict[str, Any] | None:
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as stream:
        return json.loads(stream.read())


def _in_split(relative: str, split: str) -> bool:
    *folders, name = relative.split("/")
    return split in folders or name.startswith((f"{split}-", f"{split}_", f"{split}."))


def data_files(location: str, split: str | None) -> list[str]:
    """The data files of one input, in order (see the module docstring for the layouts)."""
    fs, path = filesystem(location)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise SourceError(f"input {location!r} does not exist")
    if info.type == pafs.FileType.File:
        return [location]
    splits = _read_json(fs, posixpath.join(path, "dataset_dict.json"))
    if splits is not None:
        names = list(splits.get("splits") or [])
        if split is None and len(names) != 1:
            raise SourceError(f"{location} holds the splits {names}: choose one with --split")
        if (split or names[0]) not in names:
            raise SourceError(f"{location} has no split {split!r}; it has {names}")
        return data_files(resolve(location, split or names[0]), None)
    state = _read_json(fs, posixpath.join(path, "state.json"))
    if state is not None:
        if split is not None and state.get("_split") not in (None, split):
            raise SourceError(f"{location} is the {state['_split']!r} split, not {split!r}")
        return [resolve(location, entry["filename"]) for entry in state.get("_data_files", [])]
    found = sorted(posixpath.relpath(entry.path, path)
                   for entry in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                   if entry.type == pafs.FileType.File and entry.path.endswith(EXTENSIONS))
    kept = [relative for relative in found if split is None or _in_split(relative, split)]
    if not kept:
        wanted = f" of split {split!r}" if split is not None else ""
        raise SourceError(f"{location} holds no parquet or Arrow files{wanted} (nor a save_to_disk folder)")
    return [resolve(location, relative) for relative in kept]


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """Row-group ranges of the parquet files, one unit per Arrow file."""
    units: list[WorkUnit] = []
    for location in inputs:
        for file in data_files(location, options.split):
            if file.endswith(".arrow"):
                units.append(WorkUnit(file, identity=file_identity(file)))
            else:
                units += parquet_units([file], options.rows_per_shard)
    return units


def _open_arrow(stream: Any) -> Any:
    """A reader of the record batches of an Arrow file: the stream format ``save_to_disk`` writes, or the
    random-access file format."""
    try:
        return pa.ipc.open_stream(stream)
    except pa.ArrowInvalid:
        stream.seek(0)
        return pa.ipc.open_file(stream)


def _batches(reader: Any) -> Iterator[pa.RecordBatch]:
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        yield from reader


def schema_of(path: str) -> pa.Schema:
    """The Arrow schema of a parquet or Arrow file."""
    fs, inner = filesystem(path)
    with fs.open_input_file(inner) as stream:
        return _open_arrow(stream).schema if path.endswith(".arrow") else pq.ParquetFile(stream).schema_arrow


def read_arrow(unit: WorkUnit, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]] | Skip]:
    """The rows of an Arrow file as dicts of ``columns``, batch by batch; a file that breaks off mid-way
    skips what it could not read (counted), as an unreadable parquet row group does."""
    fs, path = filesystem(unit.path)
    row = unit.first_row
    try:
        stream = fs.open_input_file(path)
        batches = _batches(_open_arrow(stream))
        for batch in batches:
            values = {name: batch.column(name).to_pylist() for name in columns}
            for i in range(batch.num_rows):
                yield row + i, {name: values[name][i] for name in columns}
            row += batch.num_rows
    except (OSError, pa.ArrowException) as error:
        yield Skip(row, "unreadable_file", f"cannot read the Arrow file past row {row}: {error}")


# --------------------------------------------------------------------------- rows


def _json_type(kind: pa.DataType) -> bool:
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _json_type(kind.value_type)
    if pa.types.is_struct(kind):
        return all(_json_type(kind.field(i).type) for i in range(kind.num_fields))
    return any(check(kind) for check in (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer,
                                         pa.types.is_floating, pa.types.is_boolean, pa.types.is_null))


@dataclass(frozen=True)
class RowSpec:
    """Which columns of a table make a sample, and whether its rows are conversations."""

    image: str | None
    captions: tuple[str, ...]
    keep: tuple[str, ...]
    conversation: bool

    @property
    def columns(self) -> list[str]:
        """Every column the rows are read with."""
        names = ["conversations"] if self.conversation else list(self.captions)
        return [*([self.image] if self.image else []), *names, *self.keep]


def row_spec(schema: pa.Schema, options: SourceOptions, where: str) -> RowSpec:
    """The columns ``options`` name (or the defaults) in a table of ``schema``; a missing one stops the build."""
    names = schema.names
    conversation = "conversations" in names
    image = options.image_column or next((name for name in IMAGE_COLUMNS if name in names), None)
    if (image is None and not conversation) or (image is not None and image not in names):
        raise SourceError(f"{where}: no image column {image or ' or '.join(IMAGE_COLUMNS)!r} (it has {names}); "
                          "name it with --image-column")
    captions: tuple[str, ...] = ()
    if not conversation:
        captions = options.caption_columns or tuple(name for name in CAPTION_COLUMNS if name in names)[:1]
        missing = [name for name in captions if name not in names]
        if not captions or missing:
            raise SourceError(f"{where}: no caption column {missing or ' or '.join(CAPTION_COLUMNS)} (it has "
                              f"{names}); name it with --caption-column")
    for name in options.keep_columns:
        if name not in names:
            raise SourceError(f"{where}: no column {name!r} to keep (it has {names})")
        if not _json_type(schema.field(name).type):
            raise SourceError(f"{where}: column {name!r} holds {schema.field(name).type}, not JSON values; "
                              "--keep-columns keeps strings, numbers, booleans and lists or structs of them")
    return RowSpec(image, captions, tuple(options.keep_columns), conversation)


def stored_image(cell: object, folder: str, context: SourceContext) -> StoredImage:
    """An image cell: an ``Image`` struct (bytes, else its path), bytes, or a file name."""
    if isinstance(cell, dict):
        cell = cell.get("bytes") if cell.get("bytes") is not None else cell.get("path")
    if isinstance(cell, bytes):
        return ingest_image(cell, context)
    if isinstance(cell, str):
        return ingest_image_file(resolve(folder, cell), context)
    raise Skipped("malformed_record", f"image is {type(cell).__name__}, not an Image, bytes or a file name")


def bagel_captions(cell: str) -> list[str] | None:
    """The captions of a string cell holding BAGEL's t2i JSON object of strings (``{"0": "a cat", ...}``), in
    the object's order; None for any other string (a caption as it is)."""
    if not cell.lstrip().startswith("{"):
        return None
    try:
        value = json.loads(cell)
    except ValueError:
        return None
    if isinstance(value, dict) and value and all(isinstance(text, str) for text in value.values()):
        return list(value.values())
    return None


def _captions(record: dict[str, Any], columns: Sequence[str]) -> list[str]:
    captions: list[str] = []
    for name in columns:
        cell = record[name]
        if isinstance(cell, str) and (parsed := bagel_captions(cell)) is not None:  # never JSON text as a caption
            captions += parsed
            continue
        values = [cell] if isinstance(cell, str) else list(cell.values()) if isinstance(cell, dict) else cell
        if not isinstance(values, list) or not all(isinstance(text, str) for text in values):
            raise Skipped("bad_captions", f"{name} is not a string, a list of strings or a struct of strings: "
                                          f"{str(cell)[:80]!r}")
        captions += values
    return captions


def row_sample(row: int, record: dict[str, Any], spec: RowSpec, name: str, folder: str,
               context: SourceContext) -> SourceSample:
    """The sample of one row of file ``name`` (its base name keys the draws); image paths resolve in ``folder``."""
    cell = record[spec.image] if spec.image else None
    if spec.conversation:
        images = [] if cell is None else cell if isinstance(cell, list) else [cell]
        sample = image_conversation(row, conversation_turns(record),
                                    [stored_image(image, folder, context) for image in images], context)
    else:
        if isinstance(cell, list) and len(cell) == 1:
            cell = cell[0]
        sample = caption_sample(row, _captions(record, spec.captions), stored_image(cell, folder, context),
                                context.rng(name, row), context)
    sample.extra = {key: record[key] for key in spec.keep} or None
    return sample


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """One sample per row; rows with an unusable image, captions or conversation are skipped."""
    try:
        schema = schema_of(unit.path)
    except (OSError, pa.ArrowException) as error:
        return iter([Skip(-1, "unreadable_file", f"cannot open the file: {error}")])
    spec = row_spec(schema, context.options, unit.path)
    rows = read_arrow(unit, spec.columns) if unit.path.endswith(".arrow") else read_parquet(unit, spec.columns)
    folder = context.options.image_root or parent(unit.path)
    return samples_of(rows, lambda row, record: row_sample(row, record, spec, unit.path, folder, context))
