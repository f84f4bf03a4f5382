"""Input schemas checked up front: the first bytes of the first files and the first rows, before a build starts.

A build of a large input takes hours; a wrong ``--source`` or a column of the wrong shape should cost one line
at once, not a run that skips every row (or, worse, one that succeeds on the wrong reading). :func:`check`
looks at what each source needs (docs/reference/sources.md) in the first :data:`FILES_CHECKED` input files:

* the file type, from its first bytes (parquet, Arrow, tar, gzip, JSON lines, text, other binary): a file
  the source cannot read names the sources that can ("this is parquet: did you mean --source t2i/edit/hf/urls?");
* t2i: the ``image`` and ``captions`` columns, and ``captions`` cells that are BAGEL's JSON objects of strings
  (a plain string column would skip every row).

Rows that are merely bad (a corrupt image, one malformed caption) are left to the build, which counts them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow.parquet as pq

from mmidx.sources import SourceError
from mmidx.sources.inputs import filesystem

FILES_CHECKED = 4  # input files whose type is checked (object storage: one request each)
ROWS_CHECKED = 16  # first rows whose cells are checked

# The file types each source reads, and (for the hint) what they are called.
READS: dict[str, tuple[str, ...]] = {
    "t2i": ("parquet",), "edit": ("parquet",), "hf": ("parquet", "arrow"),
    "vlm": ("jsonl", "text"), "chat": ("jsonl", "text"), "text": ("jsonl", "text"),
    "video_gen": ("jsonl", "text"), "prompts": ("jsonl", "text"), "wds": ("tar", "gzip"),
    "urls": ("parquet", "jsonl", "text", "gzip"),
}
# Formats whose files cannot be empty: a 0-byte one is a copy or download that did not finish.
NEVER_EMPTY = {".parquet": "parquet", ".arrow": "an Arrow file", ".tar": "a tar archive", ".tgz": "gzip-compressed",
               ".gz": "gzip-compressed"}
TYPE_NAMES = {"parquet": "parquet", "arrow": "an Arrow file", "tar": "a tar archive", "gzip": "gzip-compressed",
              "jsonl": "JSON lines", "text": "text", "binary": "binary data (not parquet, Arrow, tar or text)"}


def file_type(head: bytes) -> str:
    """The type of a file from its first bytes (at least 512 of them where the file has them)."""
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1") or head.startswith(b"\xff\xff\xff\xff"):  # file or stream IPC format
        return "arrow"
    if head[257:262] == b"ustar":
        return "tar"
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 4:  # not a character cut off at the end of the head
            return "binary"
        text = head[:error.start].decode("utf-8")
    if "\x00" in text:
        return "binary"
    return "jsonl" if text.lstrip().startswith(("{", "[")) else "text"


def _head(location: str) -> bytes:
    fs, path = filesystem(location)
    with fs.open_input_stream(path) as stream:
        return stream.read(512)


def check(source: str, files: Sequence[str]) -> None:
    """Refuse, in one line, inputs that ``source`` cannot read; see the module docstring."""
    if source not in READS:  # mmidx.write's function source: its inputs are the user's, not files
        return
    for location in list(dict.fromkeys(files))[:FILES_CHECKED]:
        head = _head(location)
        if not head:
            _check_empty(location)
            continue  # an empty text file: no rows, as the build reports
        kind = file_type(head)
        if kind in READS[source]:
            continue
        # plain text that is not JSON lines: a prompt list or a CSV/TSV table, not a JSONL source's input
        readers = [name for name, kinds in READS.items() if kind in kinds and (kind != "text" or name in
                                                                               ("prompts", "urls"))]
        hint = f"did you mean --source {'/'.join(readers)}? " if readers else ""
        raise SourceError(f"{location}: this is {TYPE_NAMES[kind]}: {hint}(--source {source} reads "
                          f"{' or '.join(TYPE_NAMES[k] for k in READS[source])})")
    if source == "t2i" and files:
        _check_t2i(files[0])


def _check_empty(location: str) -> None:
    """Refuse an empty file of a format that is never empty (:data:`NEVER_EMPTY`), saying what to do."""
    what = next((name for suffix, name in NEVER_EMPTY.items() if location.split("?")[0].endswith(suffix)), None)
    if what is not None:
        raise SourceError(f"{location}: the file is empty (0 bytes), so it is not {what}: a copy or download that "
                          "did not finish? Write it again, or leave it out of the inputs")


def _check_t2i(location: str) -> None:
    """The first file of a t2i build has ``image`` and ``captions`` columns, its captions BAGEL's JSON objects."""
    fs, path = filesystem(location)
    with fs.open_input_file(path) as stream:
        try:
            parquet = pq.ParquetFile(stream)
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError; it names no file
            raise SourceError(f"{location}: not a readable parquet file ({' '.join(str(error).split())}); write it "
                              "again, or leave it out of the inputs") from error
        names = parquet.schema_arrow.names
        missing = [name for name in ("image", "captions") if name not in names]
        if missing:
            raise SourceError(f"{location}: no column {' or '.join(missing)} (it has {', '.join(names)}); --source "
                              "t2i reads image (encoded bytes) and captions (a JSON object of strings); other "
                              "columns: --source hf --image-column NAME --caption-column NAME")
        if parquet.metadata.num_row_groups == 0:
            return
        cells = [cell for cell in parquet.read_row_group(0, columns=["captions"]).column(0).to_pylist()[:ROWS_CHECKED]
                 if cell is not None]
    if cells and not any(_is_caption_object(cell) for cell in cells):
        raise SourceError(f"{location}: captions are not BAGEL's JSON objects of strings ({{\"0\": \"a cat\", ...}}) "
                          f"but e.g. {str(cells[0])[:60]!r}: every row would be skipped; write each cell as a JSON "
                          "object, or build plain caption columns with --source hf --caption-column captions")


def _is_caption_object(cell: object) -> bool:
    try:
        value = json.loads(cell) if isinstance(cell, str | bytes) else None
    except ValueError:
        return False
    return isinstance(value, dict) and all(isinstance(text, str) for text in value.values())
