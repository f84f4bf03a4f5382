"""The mmidx on-disk format, version 1: the specification, and the functions that read and write it.

Purpose
-------
A dataset is built once, offline, and then read by index, in microseconds, by every rank of a
training job for months. So the format is a handful of large files that are memory-mapped and never
parsed at read time; every array a reader needs is a zero-copy view of a mapped file.

A dataset is named by a *prefix* ``P`` (a path without suffix) and consists of:

==================  ==========================================================================
file                content
==================  ==========================================================================
``P.idx``           Megatron MMIDIDX v1 index of the token stream (byte-compatible)
``P.bin``           token ids of every text sequence, back to back
``P.images``        encoded images (JPEG/PNG/WebP/... bytes as given), back to back
``P.plan``          sequence-plan records, view and image tables (aligned arrays)
``P.meta.json``     metadata: version, counts, tokenizer, build config, checksum of every file
==================  ==========================================================================

A *text* dataset (``kind == "text"``: one token sequence per document, the shape Megatron's
``preprocess_data.py`` writes) has only ``P.idx``, ``P.bin`` and ``P.meta.json``: its sequence plan
is implied (one text element with loss per sequence). Any Megatron ``.idx``/``.bin`` pair without
metadata opens the same way.

Concepts
--------
* **sample**: one raw row of a source (a caption+image pair, an edit trajectory, a conversation).
  In the token stream a sample is a Megatron *document*: ``document_indices[s] ..
  document_indices[s + 1]`` are the sequence numbers of sample ``s``'s texts.
* **view**: one materialised augmentation of a sample (BAGEL draws a caption, an edit
  sub-trajectory, a mode per epoch; the builder draws K of them, and epoch ``e`` reads view
  ``e mod K``). A view is an ordered list of *elements* (its sequence plan). Views share the
  sample's texts and images by reference: nothing is stored twice.
* **element**: one plan record: kind (text / vae_image / vit_image), flags, and a *payload*: the
  index of a text among the sample's sequences, or of an image among the sample's images.
  Payloads are local to the sample, so merging datasets never rewrites element records.

Token stream: ``P.idx`` and ``P.bin`` (Megatron-Core ``IndexedDataset``, MMIDIDX version 1)
-------------------------------------------------------------------------------------------
All integers little-endian. ``n`` = number of sequences, ``d`` = number of documents + 1.

==========  ============  ==============================================================
offset      size          field
==========  ============  ==============================================================
0           9             magic ``b"MMIDIDX\\x00\\x00"``
9           8             uint64 version, always 1
17          1             uint8 dtype code of the tokens (below)
18          8             uint64 ``n``, the sequence count
26          8             uint64 ``d``, the length of the document index (documents + 1)
34          4 n           int32 ``sequence_lengths`` (tokens per sequence)
34+4n       8 n           int64 ``sequence_pointers`` (byte offset of each sequence in ``P.bin``)
34+12n      8 d           int64 ``document_indices`` (0, ..., n: sequence ranges of documents)
34+12n+8d   n             int8 ``sequence_modes``, only in files written by Megatron's builder with
                          ``multimodal=True``; the header does not say so, the file size does
==========  ============  ==============================================================

Dtype codes (Megatron's ``DType``): 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
7 float32, 8 uint16. mmidx writes uint16 when the vocabulary has fewer than 65,500 ids and int32
otherwise, as Megatron's ``DType.optimal_dtype`` does. ``sequence_pointers[i]`` equals the sum of
``sequence_lengths[:i]`` times the token size; ``P.bin`` is exactly the last pointer plus the last
sequence's bytes. The arrays start at offset 34, so they are not naturally aligned: readers use
unaligned loads (numpy does so transparently; the Cython kernels read them with ``memcpy``).

Images: ``P.images``
--------------------
The encoded bytes of every image, concatenated without padding; image ``j`` is
``P.images[image_offsets[j]:image_offsets[j + 1]]``. Width, height, format and mode were probed at
build time and live in ``P.plan`` (``image_info``), so the index knows every image's token count
without decoding it.

Plan: ``P.plan``
----------------
A small container of aligned arrays, readable with nothing but ``json`` and ``numpy``:

======  ======  ===================================================================
offset  size    field
======  ======  ===================================================================
0       8       magic ``b"MMIDXPLN"``
8       8       uint64 container version, 1
16      8       uint64 ``H``, byte length of the JSON header
24      H       UTF-8 JSON header, padded with spaces so that ``24 + H`` is a multiple of 64
24+H    ...     the arrays, each starting at a multiple of 64 bytes (zero padding between)
======  ======  ===================================================================

The header is ``{"arrays": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}`` with
``offset`` counted from the start of the file and ``dtype`` in numpy's ``descr`` form. The arrays
follow each other in header order, and the file ends exactly at the end of the last one. Version 1
requires these arrays (S samples, V views, E elements, I images; extra arrays are ignored):

=========================  ==========  ==========  =============================================
name                       dtype       shape       meaning
=========================  ==========  ==========  =============================================
``sample_view_offsets``    int64       S + 1       views of sample s: ``[o[s], o[s+1])``
``sample_image_offsets``   int64       S + 1       images of sample s: ``[o[s], o[s+1])``
``sample_origin``          int64       S, 2        (source file number, row in that file)
``view_element_offsets``   int64       V + 1       elements of view v: ``[o[v], o[v+1])``
``elements``               ELEMENT     E           plan records (below)
``image_offsets``          int64       I + 1       byte offsets into ``P.images``
``image_info``             IMAGE       I           probed width, height, format, mode
=========================  ==========  ==========  =============================================

Optional arrays (version 1 readers that predate them ignore them; both or neither are present):

=========================  ==========  ==========  =============================================
``sample_extra_offsets``   int64       S + 1       byte range of sample s in ``sample_extra``
``sample_extra``           uint8       any         UTF-8 JSON object per sample (e.g. an RL
                                                   prompt's ``prompt_id``, ``metadata``, media)
=========================  ==========  ==========  =============================================

``ELEMENT`` (16 bytes): ``kind`` uint8 (0 text, 1 vae_image, 2 vit_image); ``flags`` uint8
(bit 0 loss, 1 enable_cfg, 2 special_token_loss, 3 split_start, 4 split_end, 5 has_frame_delta);
``img_num`` uint16 (the image count BAGEL's resize rule divides ``max_pixels`` by; 1 unless a
source says otherwise); ``frame_delta`` int32 (rope-id advance after a video frame, valid when its
flag is set); ``special_token_label`` int32 (-1 = none); ``payload`` int32 (local text or image
number within the sample).

``IMAGE`` (12 bytes): ``width`` int32, ``height`` int32, ``format`` uint8 (``IMAGE_FORMATS``),
``mode`` uint8 (``IMAGE_MODES``), ``flags`` uint8 (bit 0: has transparency), one pad byte.

Metadata: ``P.meta.json``
-------------------------
A JSON object with ``format`` = ``"mmidx"``, ``format_version``, ``kind`` (``"multimodal"`` or
``"text"``), ``counts`` (samples, sequences, tokens, views, elements, images, image_bytes),
``token_dtype``, ``tokenizer`` (identity: name or path, class, vocabulary size, sha256 of its
vocabulary), ``special_tokens`` (ids of ``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``,
``<|vision_end|>``, and the end-of-document id), ``sources`` (the input files ``sample_origin``
numbers), ``build`` (the build configuration), ``files`` (for each file: name relative to the
prefix's folder, size in bytes, and its checksum under the algorithm's name: ``xxh3_128`` (xxHash's
XXH3 128-bit, hex, what builders write) or ``sha256`` (datasets written before, still verified);
exactly one per file) and ``meta_sha256``: the sha256 of the canonical JSON
(sorted keys, no spaces) of everything else, so that the metadata checks itself. The file holds
exactly ``json.dumps(meta, indent=1, sort_keys=True)`` plus a newline, and readers insist on those
bytes, so that not even a whitespace change goes unnoticed.

Sharded datasets: ``P.meta.json``, ``P.shards.table``, ``P.shards/`` (format version 2)
---------------------------------------------------------------------------------------
A build of many work units ends without copying a byte: its dataset is the units' shards, each a
complete version-1 dataset of the same kind, tokenizer and special tokens, with a small table in front.
Sample ``i`` of the dataset is sample ``i - o`` of the shard whose samples start at ``o``; the shards'
samples follow each other in table order, exactly as ``mmidx merge`` of them would number them.

* ``P.shards/NNNNN/shard.*``: shard number ``NNNNN`` (zero-padded to at least five digits), a version-1
  dataset (its ``.meta.json``, ``.idx``, ``.bin`` and for multimodal data ``.images`` and ``.plan``).
* ``P.shards.table``: an array container like ``P.plan`` (same preamble, header and alignment rules)
  with the magic ``b"MMIDXSHD"`` and these arrays, K being the metadata's ``shards``:

  =====================  ==========  ============  ==============================================
  name                   dtype       shape         meaning
  =====================  ==========  ============  ==============================================
  ``shard_numbers``      int64       K             the folder number of each shard, strictly rising
  ``shard_offsets``      int64       K + 1, C      running totals of the shards' counts: row 0 is
                                                   zeros, row k + 1 adds shard k's; C columns, the
                                                   kind's counts in the order of ``KIND_COUNTS``
                                                   (samples, sequences, tokens, then for multimodal
                                                   data views, elements, images, image_bytes)
  ``shard_meta_sha256``  uint8       K, 32         each shard's ``meta_sha256``, as raw bytes
  =====================  ==========  ============  ==============================================

* ``P.meta.json``: ``format_version`` 2, ``layout`` = ``"sharded"``, ``shards`` = K, ``kind``,
  ``token_dtype``, ``counts`` (the totals: the table's last row), ``tokenizer``, ``special_tokens`` and
  ``build`` as for one set of files; ``files`` lists only ``shards`` (the table), and each shard's own
  metadata lists its files and their checksums. A dataset without ``layout`` is ``"single"``.

Opening checks the table against the metadata in O(K) (``read_shard_table``) and maps nothing else; a
shard is opened when it is first read, checked as any dataset is, and refused unless its metadata's
checksum is the table's, its counts are the table's row difference, and its kind, token dtype, tokenizer
and special tokens are the dataset's. At most a bounded number of shards are mapped at once
(``mmidx.read.shards``), and a mapped file holds no file descriptor, so a dataset of any number of
shards opens within any descriptor limit. ``mmidx merge P --output Q`` writes the same samples as one
set of version-1 files, for tools that need a single Megatron ``.idx``/``.bin`` pair.

Writing and version rules
-------------------------
* Files are written under ``*.partial`` names, fsynced, and renamed into place in this order:
  ``P.bin``, ``P.images``, ``P.plan``, ``P.meta.json``, then ``P.idx`` last, after the old ``P.idx``
  and ``P.meta.json`` were removed. An interrupted build therefore never leaves a set of files
  that opens: without ``P.idx`` neither mmidx nor Megatron opens the prefix, and mmidx checks
  every file's size against the metadata.
  A sharded dataset's shards are complete before the table is written; then, after the old ``P.idx``
  and ``P.meta.json`` were removed, ``P.shards.table`` and ``P.meta.json`` last: without it nothing opens.
* ``format_version`` changes only when a version-1 reader would misread the data (or find none: a
  sharded dataset is version 2, which a version-1 reader refuses with a message to upgrade; a dataset of
  one set of files stays version 1, so that every earlier reader opens it). Readers refuse
  versions newer than they know, with a message to upgrade. Additive changes (new metadata keys,
  new ``P.plan`` arrays) keep the version; readers ignore what they do not know.
* Opening checks, in O(1): magics, versions, dtype codes, the metadata's own checksum and schema
  (the type and range of every field above), every array's size against its file's size, and
  counts across files. A prefix with ``P.plan`` or ``P.images`` but no ``P.meta.json`` is refused.
  Reads check every file-derived index they use (overflow-proof) before dereferencing it; whatever
  sizes something from whole arrays (GPT and pack indices) first checks the O(n) invariants
  (monotone offsets, pointers equal to the cumulative sizes, payloads inside their sample, known
  kinds and formats). ``mmidx verify`` adds the checksums of all files and probes every image's
  header against ``image_info`` (``--decode``: decodes every image).

Precached encodings: ``P.enc.NAME.bin``, ``P.enc.NAME.idx``, ``P.enc.NAME.json``
--------------------------------------------------------------------------------
Optional streams beside a dataset, attached without rewriting it (``mmidx precache``): the outputs
of a frozen encoder, one record per (image, transform, img_num) or per text sequence. ``NAME`` is
made of letters, digits, ``_`` and ``-``; :func:`encoding_path` names the files.

* ``P.enc.NAME.bin``: the records' values back to back, each starting at a multiple of 64 bytes
  (zero padding between), little-endian, in the dtype the JSON names (bf16 as its 16 raw bits).
* ``P.enc.NAME.idx``: magic ``b"MMIDXENC"``, uint64 version (that of the JSON), uint64 record count ``n``, then
  ``n`` ``ENCODING_RECORD`` (48 bytes): ``item`` int64 (the global image number, an index of
  ``image_info``, or the global sequence number of a text), ``img_num`` int32 (the element's
  img_num; 0 for texts), ``ndim`` int32 (1..4), ``shape`` 4 × int32 (unused dims 0), ``offset``
  int64 and ``nbytes`` int64 (the record's bytes in ``P.enc.NAME.bin``). Records are sorted by
  (item, img_num), each pair once. An image record is (C, h, w), or (2, C, h, w) for moments
  (mean, then log-variance); a text record is (L, D), L the sequence's token count (an encoder that
  read the token ids); a *text-input* record (version 2) is (n, D): the rows an encoder with a
  tokenizer of its own returned for the text's string (its masked-in rows when ``store_pad_tokens``
  is false), n unrelated to the dataset's token count.
* ``P.enc.NAME.json``: ``format`` = ``"mmidx-encoding"``, ``format_version``, ``name``,
  ``modality`` (image/text), ``transform`` (vae/vit; null for text) and ``transform_args``,
  ``img_num_rule``, ``encoder`` (the factory's spec string), ``weights_version`` (user-given or
  null), ``dtype``, ``store`` (moments/mean/sample/tensor), ``shape_rule``, ``dataset`` (the
  source's ``meta_sha256`` and counts), ``counts`` (records), ``files`` (bytes and xxh3_128 of the
  .bin and .idx) and ``meta_sha256`` over the rest, written in the canonical form of
  ``P.meta.json``. Version 2 adds ``input`` = ``"text"`` (required, text modality only),
  ``store_pad_tokens`` and ``encoder_kwargs``; version 1 has no ``input`` (token-aligned texts).

Readers check the magic, version, sizes, order and every record's offset, shape and size against
the files before any view is made; a stream whose ``dataset`` checksum is not the dataset's own is
refused. Version rule: a stream is written with the lowest version that describes it (1 for image
and token-aligned text records, byte-identical to earlier mmidx; 2 only for text-input records), and
a reader reads every version up to its own and refuses newer ones, so an older mmidx refuses a
text-input stream instead of misreading it as token-aligned. Written like a build: ``.partial`` files,
data first, the JSON last; readers need the JSON, so an interrupted precache leaves nothing that opens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from mmidx.errors import MMIDXError, option

FORMAT_NAME = "mmidx"
FORMAT_VERSION = 1  # what a dataset of one set of files is written as
SHARDED_FORMAT_VERSION = 2  # what a sharded dataset is written as (a version-1 reader would find no files)
READ_FORMAT_VERSION = 2  # the newest version this mmidx reads
# File checksums, by the name the metadata records them under. Builders write xxh3_128: about 10x
# sha256's speed here and off the writer's critical path (benchmarks/bench_write.py); a checksum
# guards against corruption, not tampering. sha256 is what earlier datasets carry, and still verifies.
FILE_HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
FILE_HASH = "xxh3_128"

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
MEGATRON_HEADER_SIZE = 34

PLAN_MAGIC = b"MMIDXPLN"
PLAN_VERSION = 1
PLAN_PREAMBLE_SIZE = 24
PLAN_ALIGNMENT = 64

# Megatron's DType codes.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_CODES.items()}

# Element kinds and flag bits of ELEMENT records.
TEXT, VAE_IMAGE, VIT_IMAGE = 0, 1, 2
KIND_NAMES = ("text", "vae_image", "vit_image")
FLAG_LOSS = 1 << 0
FLAG_ENABLE_CFG = 1 << 1
FLAG_SPECIAL_TOKEN_LOSS = 1 << 2
FLAG_SPLIT_START = 1 << 3
FLAG_SPLIT_END = 1 << 4
FLAG_HAS_FRAME_DELTA = 1 << 5
KNOWN_FLAGS = (1 << 6) - 1

ELEMENT_DTYPE = np.dtype(
    [
        ("kind", "u1"),
        ("flags", "u1"),
        ("img_num", "<u2"),
        ("frame_delta", "<i4"),
        ("special_token_label", "<i4"),
        ("payload", "<i4"),
    ]
)
IMAGE_DTYPE = np.dtype(
    [("width", "<i4"), ("height", "<i4"), ("format", "u1"), ("mode", "u1"), ("flags", "u1"), ("pad", "u1")]
)
IMAGE_FLAG_TRANSPARENCY = 1
KNOWN_IMAGE_FLAGS = IMAGE_FLAG_TRANSPARENCY  # every other bit of image_info.flags is 0, and pad is 0
PACK_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "start_of_image", "end_of_image")  # ids packing needs
IMAGE_SPECIAL_TOKENS = ("start_of_image", "end_of_image")  # of those, the ones only images need

# Codes of image formats and modes in IMAGE records (index = code; 0 = unknown).
IMAGE_FORMATS = ("unknown", "JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "MPO", "JPEG2000")
IMAGE_MODES = (
    "unknown", "1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "I", "I;16", "F", "LAB", "HSV",
)

# The arrays of P.plan, with their dtypes, in file order.
PLAN_ARRAYS: dict[str, np.dtype] = {
    "sample_view_offsets": np.dtype("<i8"),
    "sample_image_offsets": np.dtype("<i8"),
    "sample_origin": np.dtype("<i8"),
    "view_element_offsets": np.dtype("<i8"),
    "elements": ELEMENT_DTYPE,
    "image_offsets": np.dtype("<i8"),
    "image_info": IMAGE_DTYPE,
}

# Optional arrays of P.plan: free-form JSON per sample.
PLAN_OPTIONAL_ARRAYS: dict[str, np.dtype] = {
    "sample_extra_offsets": np.dtype("<i8"),
    "sample_extra": np.dtype("u1"),
}

SUFFIXES = {"idx": ".idx", "bin": ".bin", "images": ".images", "plan": ".plan", "meta": ".meta.json",
            "shards": ".shards.table"}
SHARDS_FOLDER_SUFFIX = ".shards"  # a sharded dataset's shards: P.shards/NNNNN/shard.*
SHARDS_MAGIC = b"MMIDXSHD"
# The arrays of P.shards.table, with their dtypes, in file order.
SHARD_TABLE_ARRAYS: dict[str, np.dtype] = {
    "shard_numbers": np.dtype("<i8"),
    "shard_offsets": np.dtype("<i8"),
    "shard_meta_sha256": np.dtype("u1"),
}

ENCODING_MAGIC = b"MMIDXENC"
ENCODING_VERSION = 2  # the newest stream version this mmidx reads (and writes, for text-input records)
ENCODING_HEADER_SIZE = 24
ENCODING_ALIGNMENT = 64  # each record's values start at a multiple of this in P.enc.NAME.bin
ENCODING_ROLES = ("bin", "idx", "json")  # data files first, metadata last
ENCODING_RECORD = np.dtype([("item", "<i8"), ("img_num", "<i4"), ("ndim", "<i4"), ("shape", "<i4", (4,)),
                            ("offset", "<i8"), ("nbytes", "<i8")])


class FormatError(MMIDXError, ValueError):
    """A dataset file is missing, truncated, corrupted or inconsistent with the other files."""


class PrefixError(MMIDXError, ValueError):
    """A dataset prefix that cannot name a dataset's files: it ends in a folder (``out/``), not a name."""


def file_path(prefix: str | os.PathLike, role: str) -> Path:
    """The path of the file that plays ``role`` (a key of ``SUFFIXES``) for dataset ``prefix``."""
    return Path(os.fspath(prefix) + SUFFIXES[role])


def holds_dataset(prefix: str | os.PathLike) -> bool:
    """Whether ``prefix`` holds a dataset, whole or not: its index or its metadata exists (what a command writing
    there would replace)."""
    return file_path(prefix, "idx").exists() or file_path(prefix, "meta").exists()


REPORT_SUFFIX = ".report.json"  # the build report beside a dataset (mmidx.ingest.report): not one of its files


def report_path(prefix: str | os.PathLike) -> Path:
    """Where the build report of the dataset at ``prefix`` lives (written by ``mmidx build`` and ``merge``)."""
    return Path(os.fspath(prefix) + REPORT_SUFFIX)


def output_prefix(prefix: str | os.PathLike, parameter: str = "output") -> str:
    """``prefix`` as a string, or a :class:`PrefixError` when its last part is no name (``out/``, ``out/.``, a URI
    ending in ``/``): a dataset's files are the prefix plus a suffix, so ``out/`` would write hidden files
    (``out/.idx``, ``out/.bin``) that ``ls`` does not show. ``parameter`` is the setting the message names
    (``--output`` on the command line, ``output=`` in Python)."""
    text = os.fspath(prefix)
    path = (text.partition("?")[0] if "://" in text else text).replace(os.sep, "/")
    if path.rpartition("/")[2] in ("", ".", ".."):
        meant = f"{path.rstrip('/') or '.'}/NAME"
        named = option(parameter, meant)
        raise PrefixError(f"{text!r} names a folder, not a dataset: a dataset's files are its prefix plus a "
                          f"suffix (PREFIX.idx, PREFIX.bin...), so this one would write hidden files such as "
                          f"{path}.idx; did you mean {f'{named} {meant}' if named.startswith('--') else named}?")
    return text


def encoding_path(prefix: str | os.PathLike, name: str, role: str) -> Path:
    """The file ``P.enc.NAME.<role>`` (role in ``ENCODING_ROLES``) of the precached encoding ``name``."""
    if not name or name.strip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") or role not in \
            ENCODING_ROLES:
        raise ValueError(f"an encoding name is letters, digits, '_' and '-' (got {name!r}); role one of "
                         f"{ENCODING_ROLES} (got {role!r})")
    return Path(f"{os.fspath(prefix)}.enc.{name}.{role}")


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 below 65,500 ids, else int32: the choice of Megatron's ``DType.optimal_dtype``."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


# --------------------------------------------------------------------------- Megatron .idx


@dataclass(frozen=True)
class TokenIndexHeader:
    """What the header and size of a Megatron ``.idx`` file say about its arrays."""

    dtype: np.dtype
    sequence_count: int
    document_count: int  # length of document_indices, i.e. documents + 1
    multimodal: bool  # a trailing int8 mode per sequence is present

    @property
    def lengths_offset(self) -> int:
        return MEGATRON_HEADER_SIZE

    @property
    def pointers_offset(self) -> int:
        return MEGATRON_HEADER_SIZE + 4 * self.sequence_count

    @property
    def documents_offset(self) -> int:
        return MEGATRON_HEADER_SIZE + 12 * self.sequence_count

    @property
    def modes_offset(self) -> int:
        return self.documents_offset + 8 * self.document_count

    @property
    def file_size(self) -> int:
        return self.modes_offset + (self.sequence_count if self.multimodal else 0)


def read_token_index_header(path: str | os.PathLike) -> TokenIndexHeader:
    """Parse and check the header of a Megatron ``.idx`` file against the file's size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as stream:
            head = stream.read(MEGATRON_HEADER_SIZE)
    except OSError as error:
        raise FormatError(f"{path}: cannot read the token index ({error.strerror})") from error
    if len(head) < MEGATRON_HEADER_SIZE:
        raise FormatError(f"{path}: truncated token index: {size} bytes, the header alone is 34")
    if head[:9] != MEGATRON_MAGIC:
        raise FormatError(f"{path}: not a Megatron MMIDIDX index (magic {head[:9]!r})")
    (version,) = struct.unpack_from("<Q", head, 9)
    if version != MEGATRON_VERSION:
        raise FormatError(f"{path}: MMIDIDX version {version} is not supported (only 1)")
    code = head[17]
    if code not in DTYPE_CODES:
        raise FormatError(f"{path}: unknown token dtype code {code} (known: {sorted(DTYPE_CODES)})")
    sequence_count, document_count = struct.unpack_from("<QQ", head, 18)
    if document_count < 1:
        raise FormatError(f"{path}: document index length is {document_count}, must be at least 1")
    plain = TokenIndexHeader(DTYPE_CODES[code], sequence_count, document_count, multimodal=False)
    with_modes = TokenIndexHeader(DTYPE_CODES[code], sequence_count, document_count, multimodal=True)
    if size == plain.file_size:
        return plain
    if size == with_modes.file_size and sequence_count > 0:
        return with_modes
    raise FormatError(
        f"{path}: size {size} bytes does not match its header ({sequence_count} sequences, "
        f"{document_count - 1} documents need {plain.file_size} bytes, or {with_modes.file_size} "
        "with sequence modes): the file is truncated or corrupted"
    )


def write_token_index(
    path: str | os.PathLike,
    dtype: np.dtype,
    sequence_lengths: np.ndarray,
    document_indices: np.ndarray,
    sequence_modes: np.ndarray | None = None,
) -> None:
    """Write a Megatron MMIDIDX v1 ``.idx`` file; pointers are computed from the lengths."""
    dtype = np.dtype(dtype)
    lengths = np.ascontiguousarray(sequence_lengths, dtype="<i4")
    documents = np.ascontiguousarray(document_indices, dtype="<i8")
    pointers = sequence_pointers(lengths, dtype.itemsize)
    with open(path, "wb") as stream:
        stream.write(MEGATRON_MAGIC)
        stream.write(struct.pack("<QB", MEGATRON_VERSION, CODE_OF_DTYPE[dtype]))
        stream.write(struct.pack("<QQ", len(lengths), len(documents)))
        stream.write(lengths.tobytes())
        stream.write(pointers.tobytes())
        stream.write(documents.tobytes())
        if sequence_modes is not None:
            stream.write(np.ascontiguousarray(sequence_modes, dtype="i1").tobytes())
        stream.flush()
        os.fsync(stream.fileno())


def sequence_pointers(sequence_lengths: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte offset of every sequence: the exclusive cumulative sum of lengths times the token size."""
    pointers = np.zeros(len(sequence_lengths), dtype="<i8")
    if len(sequence_lengths) > 1:
        np.cumsum(sequence_lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= itemsize
    return pointers


# --------------------------------------------------------------------------- P.plan container


def aligned(offset: int, alignment: int = PLAN_ALIGNMENT) -> int:
    """``offset`` rounded up to a multiple of ``alignment`` (the plan's arrays, an encoding's records)."""
    return -(-offset // alignment) * alignment


def _descr(dtype: np.dtype) -> Any:
    return dtype.descr if dtype.fields else dtype.str


def container_layout(magic: bytes, shapes: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> tuple[bytes, list[dict]]:
    """The preamble and header of an array container (``P.plan``, ``P.shards.table``) holding arrays of the given
    dtypes and shapes (name → (dtype, shape), in file order), and each array's header entry (its ``offset``).

    What is written depends on the names, dtypes and shapes alone, so a writer that streams the arrays in pieces
    (``mmidx merge``) writes the same bytes as one holding them whole."""
    entries, offset = [], 0
    for name, (dtype, shape) in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        entries.append({"name": name, "dtype": _descr(dtype), "shape": list(shape), "offset": offset,
                        "nbytes": nbytes})
        offset = aligned(offset + nbytes)
    # The header's own length shifts every offset: lay it out once with placeholders wide enough.
    header = json.dumps({"arrays": entries}, separators=(",", ":")).encode()
    data_start = aligned(PLAN_PREAMBLE_SIZE + len(header) + 20 * len(entries))
    for entry in entries:
        entry["offset"] += data_start
    header = json.dumps({"arrays": entries}, separators=(",", ":")).encode()
    header = header.ljust(data_start - PLAN_PREAMBLE_SIZE, b" ")
    return magic + struct.pack("<QQ", PLAN_VERSION, len(header)) + header, entries


def write_container(path: str | os.PathLike, magic: bytes, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` (name → array, in this order) as an array container and fsync it."""
    head, entries = container_layout(magic, {name: (array.dtype, array.shape) for name, array in arrays.items()})
    with open(path, "wb") as stream:
        stream.write(head)
        for entry, array in zip(entries, arrays.values(), strict=True):
            stream.write(b"\x00" * (entry["offset"] - stream.tell()))
            stream.write(np.ascontiguousarray(array).tobytes())
        stream.flush()
        os.fsync(stream.fileno())


def write_plan(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` (name → array, in this order) as a ``P.plan`` container and fsync it."""
    write_container(path, PLAN_MAGIC, arrays)


def read_container(path: str | os.PathLike, buffer: Any, magic: bytes, what: str,
                   known: dict[str, np.dtype]) -> dict[str, np.ndarray]:
    """Zero-copy views of the arrays named in ``known`` (name → dtype) of an array container held in ``buffer``
    (the mapped file, anything with the buffer protocol); ``what`` names the file kind in messages.

    Checks magic, version, header, dtypes and that every array lies inside the file, aligned, in order, and that
    the file ends at the last array; arrays not in ``known`` are checked for their place and skipped. Which arrays
    must be present, and the cross-array counts, are checked by the caller.
    """
    view = memoryview(buffer)
    size = len(view)
    if size < PLAN_PREAMBLE_SIZE:
        raise FormatError(f"{path}: truncated {what} file: {size} bytes, the preamble alone is 24")
    if bytes(view[:8]) != magic:
        raise FormatError(f"{path}: not an mmidx {what} file (magic {bytes(view[:8])!r})")
    version, header_size = struct.unpack_from("<QQ", view, 8)
    if version != PLAN_VERSION:
        raise FormatError(f"{path}: {what} container version {version} is newer than this mmidx knows "
                          f"({PLAN_VERSION}); upgrade mmidx to read it")
    data_start = PLAN_PREAMBLE_SIZE + header_size
    if data_start > size or data_start % PLAN_ALIGNMENT:
        raise FormatError(f"{path}: {what} header length {header_size} does not fit the file ({size} bytes)")
    try:
        header = json.loads(bytes(view[PLAN_PREAMBLE_SIZE:data_start]).decode("utf-8"))
        entries = {entry["name"]: entry for entry in header["arrays"]}
        order = [entry["name"] for entry in header["arrays"]]
    except (ValueError, RecursionError, KeyError, TypeError) as error:
        raise FormatError(f"{path}: the {what} header is not valid JSON of the expected shape ({error})") from error
    arrays: dict[str, np.ndarray] = {}
    end = data_start
    for name in order:
        entry = entries[name]
        try:
            offset, nbytes, shape = int(entry["offset"]), int(entry["nbytes"]), tuple(int(n) for n in entry["shape"])
            dtype = np.dtype([tuple(field) for field in entry["dtype"]] if isinstance(entry["dtype"], list)
                             else entry["dtype"])
        except (KeyError, TypeError, ValueError, SyntaxError) as error:  # SyntaxError: numpy's dtype-string parser
            raise FormatError(f"{path}: {what} array {name!r} has a malformed header entry ({error})") from error
        if offset != aligned(end) or min(shape, default=0) < 0:
            raise FormatError(f"{path}: {what} array {name!r} is not where the layout puts it (offset {offset})")
        if nbytes != math.prod(shape) * dtype.itemsize or offset + nbytes > size:
            raise FormatError(f"{path}: {what} array {name!r} ({nbytes} bytes at {offset}) does not fit "
                              f"its shape {shape} or the file ({size} bytes): truncated or corrupted")
        end = offset + nbytes
        expected = known.get(name)
        if expected is not None:
            if dtype != expected:
                raise FormatError(f"{path}: {what} array {name!r} has dtype {dtype}, expected {expected}")
            arrays[name] = np.frombuffer(view, dtype=dtype, count=nbytes // dtype.itemsize,
                                         offset=offset).reshape(shape)
    if end != size:
        raise FormatError(f"{path}: {size - end} unexpected bytes after the last {what} array (file size {size})")
    return arrays


def read_plan(path: str | os.PathLike, buffer: Any) -> dict[str, np.ndarray]:
    """Zero-copy views of the arrays of a ``P.plan`` container held in ``buffer`` (:func:`read_container`'s
    checks), the required ones all present and the optional ones both or neither."""
    arrays = read_container(path, buffer, PLAN_MAGIC, "plan", {**PLAN_ARRAYS, **PLAN_OPTIONAL_ARRAYS})
    missing = [name for name in PLAN_ARRAYS if name not in arrays]
    if missing:
        raise FormatError(f"{path}: plan file lacks the arrays {missing}")
    if ("sample_extra" in arrays) != ("sample_extra_offsets" in arrays):
        raise FormatError(f"{path}: plan file has only one of sample_extra and sample_extra_offsets")
    return arrays


# --------------------------------------------------------------------------- P.shards.table


def shard_prefix(prefix: str | os.PathLike, number: int) -> str:
    """The prefix of shard ``number`` of the sharded dataset at ``prefix``: ``P.shards/NNNNN/shard``."""
    return os.path.join(f"{os.fspath(prefix)}{SHARDS_FOLDER_SUFFIX}", f"{number:05d}", "shard")


def write_shard_table(path: str | os.PathLike, numbers: np.ndarray, offsets: np.ndarray,
                      meta_sha256s: list[str]) -> None:
    """Write a ``P.shards.table`` (see the module doc) and fsync it: each shard's folder number, the running
    totals of its counts (one row per shard and a first row of zeros) and the checksum of its metadata."""
    digests = np.frombuffer(b"".join(bytes.fromhex(value) for value in meta_sha256s), dtype=np.uint8)
    write_container(path, SHARDS_MAGIC, {"shard_numbers": np.ascontiguousarray(numbers, dtype="<i8"),
                                         "shard_offsets": np.ascontiguousarray(offsets, dtype="<i8"),
                                         "shard_meta_sha256": digests.reshape(len(meta_sha256s), 32)})


def read_shard_table(path: str | os.PathLike, buffer: Any, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of a ``P.shards.table`` held in ``buffer``, checked in O(shards) against each other and the
    dataset's metadata ``meta``: shapes, strictly rising folder numbers, running totals that start at 0, never
    fall and end at the metadata's counts."""
    arrays = read_container(path, buffer, SHARDS_MAGIC, "shard table", SHARD_TABLE_ARRAYS)
    missing = [name for name in SHARD_TABLE_ARRAYS if name not in arrays]
    if missing:
        raise FormatError(f"{path}: shard table lacks the arrays {missing}")
    count, columns = meta["shards"], KIND_COUNTS[meta["kind"]]
    numbers, offsets, digests = arrays["shard_numbers"], arrays["shard_offsets"], arrays["shard_meta_sha256"]
    if numbers.shape != (count,) or offsets.shape != (count + 1, len(columns)) or digests.shape != (count, 32):
        raise FormatError(f"{path}: the shard table's arrays {numbers.shape}, {offsets.shape}, {digests.shape} do not "
                          f"describe the {count} shards of a {meta['kind']} dataset ({len(columns)} counts each)")
    if numbers[0] < 0 or np.any(np.diff(numbers) <= 0):
        raise FormatError(f"{path}: shard folder numbers are not non-negative and strictly rising: corrupted")
    if np.any(offsets[0] != 0) or np.any(np.diff(offsets, axis=0) < 0):
        raise FormatError(f"{path}: the shards' running totals do not start at 0 and rise: corrupted")
    totals = [meta["counts"][name] for name in columns]
    if offsets[-1].tolist() != totals:
        raise FormatError(f"{path}: the shards' totals {offsets[-1].tolist()} are not the metadata's counts "
                          f"{dict(zip(columns, totals, strict=True))}: the files do not belong together")
    return arrays


# --------------------------------------------------------------------------- P.meta.json


def canonical_json(obj: Any) -> bytes:
    """The byte string checksums of JSON objects are computed over: sorted keys, no spaces."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """Return ``meta`` with ``meta_sha256`` set to the checksum of all its other keys."""
    body = {key: value for key, value in meta.items() if key != "meta_sha256"}
    return {**body, "meta_sha256": hashlib.sha256(canonical_json(body)).hexdigest()}


def serialize_metadata(meta: dict[str, Any]) -> bytes:
    """The exact bytes of ``P.meta.json`` for ``meta``: signed, sorted keys, one-space indent."""
    return (json.dumps(sign_metadata(meta), indent=1, sort_keys=True) + "\n").encode()


def write_metadata(path: str | os.PathLike, meta: dict[str, Any]) -> None:
    """Write signed metadata and fsync it."""
    with open(path, "wb") as stream:
        stream.write(serialize_metadata(meta))
        stream.flush()
        os.fsync(stream.fileno())


_VERIFIED: dict[bytes, None] = {}  # sha256 of metadata bytes that passed every check below (insertion order)
VERIFIED_LIMIT = 1 << 16  # digests remembered: 2 MiB; a process reading 50,000 shards remaps each many times


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Read ``P.meta.json``; refuse it if it does not parse, fails its checksum, or is too new.

    Bytes that passed once are only parsed when read again (the same bytes give the same verdict): a shard of a
    large sharded dataset is mapped again each time it was unmapped (:mod:`mmidx.read.mapped`), and the checks,
    which serialise the metadata twice, were most of that."""
    try:
        with open(path, "rb") as stream:
            raw = stream.read()
        meta = json.loads(raw.decode("utf-8"))
    except OSError as error:
        raise FormatError(f"{path}: cannot read the metadata ({error.strerror})") from error
    except (ValueError, RecursionError) as error:  # ValueError: undecodable, not JSON, or a 5,000-digit int
        raise FormatError(f"{path}: the metadata is not valid JSON ({error}): truncated or corrupted") from error
    digest = hashlib.sha256(raw).digest()
    if digest in _VERIFIED:
        return meta
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise FormatError(f"{path}: not mmidx metadata (no \"format\": \"mmidx\")")
    if sign_metadata(meta).get("meta_sha256") != meta.get("meta_sha256"):
        raise FormatError(f"{path}: the metadata fails its own checksum (meta_sha256): it was modified or corrupted")
    if raw != serialize_metadata(meta):
        raise FormatError(f"{path}: the metadata is not byte-identical to its canonical form: it was edited")
    version = meta.get("format_version")
    if _is_int(version) and version > READ_FORMAT_VERSION:
        raise FormatError(f"{path}: format version {version!r} is newer than this mmidx reads "
                          f"({READ_FORMAT_VERSION}); upgrade mmidx")
    check_metadata_schema(path, meta)
    if len(_VERIFIED) >= VERIFIED_LIMIT:
        _VERIFIED.pop(next(iter(_VERIFIED)), None)
    _VERIFIED[digest] = None
    return meta


# How a dataset's samples are stored: in one set of files, or in shards under a table (the module doc).
LAYOUTS = ("single", "sharded")
# How a build may end (mmidx.ingest.sharded.choose_layout): "auto" ends in one set of files (one Megatron .idx/.bin
# pair, merged by copying) while that is cheap, and sharded beyond: more units than a merge keeps mapped at a
# glance, or more data than a few seconds' copy.
BUILD_LAYOUTS = ("auto", *LAYOUTS)
AUTO_SINGLE_UNITS = 64
AUTO_SINGLE_BYTES = 1 << 30
# Files and counts of each dataset kind, as the metadata must list them.
KIND_FILES = {"multimodal": ("idx", "bin", "images", "plan"), "text": ("idx", "bin")}
KIND_COUNTS = {"multimodal": ("samples", "sequences", "tokens", "views", "elements", "images", "image_bytes"),
               "text": ("samples", "sequences", "tokens")}
TOKEN_ID_LIMIT = 2**31  # token ids are stored as int32 at most


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_metadata_schema(path: str | os.PathLike, meta: dict[str, Any]) -> None:
    """Refuse metadata whose fields do not have the types and ranges this specification gives them,
    so that no reader ever trips over a wrong type: each problem is a ``FormatError`` naming the field."""

    def refuse(field: str, problem: str) -> None:
        raise FormatError(f"{path}: metadata field {field!r} {problem}: corrupted or hand-edited metadata")

    if not _is_int(meta.get("format_version")) or meta["format_version"] < 1:
        refuse("format_version", f"is {meta.get('format_version')!r}, not a positive integer")
    kind = meta.get("kind")
    if not isinstance(kind, str) or kind not in KIND_FILES:
        refuse("kind", f"is {kind!r}, not one of {sorted(KIND_FILES)}")
    if meta.get("token_dtype") not in [dtype.name for dtype in DTYPE_CODES.values()]:
        refuse("token_dtype", f"is {meta.get('token_dtype')!r}, not a Megatron token dtype")
    counts = meta.get("counts")
    if not isinstance(counts, dict):
        refuse("counts", f"is {type(counts).__name__}, not an object")
    for key in KIND_COUNTS[kind]:
        if not _is_int(counts.get(key)) or not 0 <= counts[key] < 2**63:
            refuse(f"counts.{key}", f"is {counts.get(key)!r}, not a count")
    layout = meta.get("layout", "single")
    if layout not in LAYOUTS:
        refuse("layout", f"is {layout!r}, not one of {list(LAYOUTS)}")
    expected_files = ("shards",) if layout == "sharded" else KIND_FILES[kind]
    if layout == "sharded":
        if meta["format_version"] < SHARDED_FORMAT_VERSION:
            refuse("format_version", f"is {meta['format_version']}, a sharded dataset is version "
                                     f"{SHARDED_FORMAT_VERSION}")
        if not _is_int(meta.get("shards")) or not 1 <= meta["shards"] < 2**31:
            refuse("shards", f"is {meta.get('shards')!r}, not a shard count")
    files = meta.get("files")
    if not isinstance(files, dict) or set(files) != set(expected_files):
        listed = sorted(files) if isinstance(files, dict) else type(files).__name__
        refuse("files", f"lists {listed}, a {layout} {kind} dataset has exactly {list(expected_files)}")
    for role, entry in files.items():
        if not isinstance(entry, dict) or not _is_int(entry.get("bytes")) or entry["bytes"] < 0:
            refuse(f"files.{role}.bytes", "is not a byte count")
        algorithms = [name for name in FILE_HASHES if name in entry]
        if len(algorithms) != 1:
            refuse(f"files.{role}", f"records {len(algorithms)} checksums, not one of {list(FILE_HASHES)}")
        digest = entry[algorithms[0]]
        if not isinstance(digest, str) or len(digest) != 2 * FILE_HASHES[algorithms[0]]().digest_size \
                or digest.strip("0123456789abcdef"):
            refuse(f"files.{role}.{algorithms[0]}", f"is {digest!r}, not a {algorithms[0]} hex digest")
    sources = meta.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(source, str) for source in sources):
        refuse("sources", "is not a list of file names")
    tokenizer = meta.get("tokenizer")
    if tokenizer is not None and not isinstance(tokenizer, dict):
        refuse("tokenizer", f"is {type(tokenizer).__name__}, not an object or null")
    vocab_size = (tokenizer or {}).get("vocab_size")
    if vocab_size is not None and (not _is_int(vocab_size) or not 0 < vocab_size <= TOKEN_ID_LIMIT):
        refuse("tokenizer.vocab_size", f"is {vocab_size!r}, not a vocabulary size")
    special = meta.get("special_tokens", {})
    if not isinstance(special, dict):
        refuse("special_tokens", f"is {type(special).__name__}, not an object")
    limit = vocab_size or TOKEN_ID_LIMIT
    for name, value in special.items():
        if value is not None and (not _is_int(value) or not 0 <= value < limit):
            refuse(f"special_tokens.{name}", f"is {value!r}, not a token id below {limit}")
    if not isinstance(meta.get("build", {}), dict):
        refuse("build", "is not an object")


def hash_file(path: str | os.PathLike, algorithm: str = FILE_HASH, chunk_size: int = 1 << 22) -> str:
    """Hex checksum of a file's content under ``algorithm`` (a key of ``FILE_HASHES``), read in chunks."""
    digest = FILE_HASHES[algorithm]()
    with open(path, "rb") as stream:
        while chunk := stream.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def file_hash_algorithm(entry: dict[str, Any]) -> str:
    """The checksum algorithm a metadata ``files`` entry records (schema-checked: exactly one)."""
    return next(name for name in FILE_HASHES if name in entry)


def fsync_directory(path: str | os.PathLike) -> None:
    """Make renames inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
