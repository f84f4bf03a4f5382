"""Write mmidx datasets: append samples, finalize crash-safely, merge finished datasets into one.

The layout written is specified in :mod:`mmidx.format`. Index arrays grow in numpy buffers (never
Python lists of per-sequence values); token and image bytes stream to ``*.partial`` files, are
hashed as they are written and sent on to the disk as they grow, so finalizing costs one pass over the
small index arrays and the fsync of the last few MiB.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx.images.decode import ImageError, check_decodes, open_image
from mmidx.io import libc
from mmidx.io.files import errors_naming
from mmidx.sources.elements import _INT32_MAX, Element, StoredImage


class _Growable:
    """An append-only numpy array built in batches: values are collected in a list, which is cheap per
    sample, and turned into a numpy chunk every ``BATCH`` values (bounded memory, no per-value numpy call)."""

    BATCH = 1 << 16

    def __init__(self, dtype: np.dtype | str, initial: Sequence[Any] = (), width: int | None = None):
        self._dtype = np.dtype(dtype)
        self._empty_shape = (0,) if width is None else (0, width)
        self._chunks: list[np.ndarray] = []
        self._stored = 0
        self._pending: list[Any] = list(initial)
        self.last = self._pending[-1] if self._pending else None

    def append(self, value: Any) -> None:
        self._pending.append(value)
        self.last = value
        if len(self._pending) >= self.BATCH:
            self._flush()

    def extend(self, values: list[Any]) -> None:
        """Append every value of ``values`` (one call per sample rather than per value)."""
        if values:
            self._pending += values
            self.last = values[-1]
            if len(self._pending) >= self.BATCH:
                self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._chunks.append(np.array(self._pending, dtype=self._dtype))
            self._stored += len(self._pending)
            self._pending = []

    def __len__(self) -> int:
        return self._stored + len(self._pending)

    def array(self) -> np.ndarray:
        self._flush()
        if not self._chunks:
            self._chunks = [np.zeros(self._empty_shape, dtype=self._dtype)]
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        return self._chunks[0]


class _HashingWriter:
    """A buffered binary ``*.partial`` file that hashes everything written to it.

    Every ``WRITE_BEHIND`` bytes it asks the kernel to start writing them to the disk, so the disk works
    while the caller produces the next ones and the fsync that ends the file waits for the last few only.
    """

    WRITE_BEHIND = 1 << 24

    def __init__(self, path: Path):
        self.path = path
        self.stream = open(path, "wb", buffering=1 << 22)
        self.digest = fmt.FILE_HASHES[fmt.FILE_HASH]()
        self.size = 0
        self._sent = 0  # bytes whose writeback has been started

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        try:  # not errors_naming: a context manager per write costs more than the write of a short text
            self.stream.write(view)
            self.size += len(view)
            if self.size - self._sent >= self.WRITE_BEHIND:
                self.stream.flush()
                libc.start_writeback(self.stream.fileno(), self._sent, self.size - self._sent)
                self._sent = self.size
        except OSError as error:
            with errors_naming(self.path):
                raise error

    def close(self) -> None:
        if not self.stream.closed:
            with errors_naming(self.path):
                self.stream.flush()
                os.fsync(self.stream.fileno())
                self.stream.close()


def _partial(prefix: str, role: str) -> Path:
    return Path(str(fmt.file_path(prefix, role)) + ".partial")


def withdraw_dataset(prefix: str | os.PathLike) -> None:
    """Make the dataset at ``prefix`` stop opening, and lose the report that describes it: its index and metadata
    removed (what a writer does before it replaces a dataset's files; a sharded dataset's shards are left)."""
    for path in (fmt.file_path(prefix, "idx"), fmt.file_path(prefix, "meta"), fmt.report_path(prefix)):
        path.unlink(missing_ok=True)


def remove_partial_files(prefix: str | os.PathLike) -> None:
    """Delete leftovers of an interrupted build of ``prefix`` (they never open as a dataset)."""
    for role in fmt.SUFFIXES:
        _partial(os.fspath(prefix), role).unlink(missing_ok=True)


class _DatasetWriter:
    """The files of one dataset under construction, and the order in which they become visible."""

    def __init__(self, prefix: str | os.PathLike, kind: str, token_dtype: np.dtype):
        if kind not in ("multimodal", "text"):
            raise ValueError(f"kind must be 'multimodal' or 'text', not {kind!r}")
        self.prefix = fmt.output_prefix(prefix, "prefix")
        self.kind = kind
        self.token_dtype = np.dtype(token_dtype)
        if self.token_dtype not in fmt.CODE_OF_DTYPE:
            raise ValueError(f"token dtype {self.token_dtype} has no MMIDIDX code")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        remove_partial_files(self.prefix)
        self.tokens = _HashingWriter(_partial(self.prefix, "bin"))
        self.images = _HashingWriter(_partial(self.prefix, "images")) if kind == "multimodal" else None
        self._index_files: dict[str, _HashingWriter] = {}

    def commit(
        self,
        sequence_lengths: np.ndarray,
        document_indices: np.ndarray,
        plan: dict[str, np.ndarray] | None,
        meta: dict[str, Any],
    ) -> Path:
        """Write the index, plan and metadata, then rename every file into place (``P.idx`` last)."""
        fmt.write_token_index(_partial(self.prefix, "idx"), self.token_dtype, sequence_lengths, document_indices)
        if plan is not None:
            fmt.write_plan(_partial(self.prefix, "plan"), plan)
        return self.publish(meta)

    def index_file(self, role: str) -> _HashingWriter:
        """The ``*.partial`` file of ``role`` ("idx" or "plan"), for a caller that writes it in pieces (``mmidx
        merge``) before :meth:`publish`; it is hashed as it is written."""
        writer = self._index_files[role] = _HashingWriter(_partial(self.prefix, role))
        return writer

    def publish(self, meta: dict[str, Any]) -> Path:
        """Write the metadata of the written files, then rename every file into place (``P.idx`` last)."""
        written = {"bin": self.tokens, **self._index_files}
        if self.images is not None:
            written["images"] = self.images
        for writer in written.values():
            writer.close()
        roles = ["bin", "images", "plan", "idx"] if self.kind == "multimodal" else ["bin", "idx"]
        files = {}
        for role in roles:
            path = _partial(self.prefix, role)
            digest = written[role].digest.hexdigest() if role in written else fmt.hash_file(path)
            files[role] = {"name": fmt.file_path(self.prefix, role).name, "bytes": path.stat().st_size,
                           fmt.FILE_HASH: digest}
        meta = {**meta, "format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "kind": self.kind,
                "token_dtype": self.token_dtype.name, "files": files}
        fmt.write_metadata(_partial(self.prefix, "meta"), meta)
        withdraw_dataset(self.prefix)  # before any of the old dataset's files is replaced
        for role in [r for r in roles if r != "idx"] + ["meta", "idx"]:
            os.replace(_partial(self.prefix, role), fmt.file_path(self.prefix, role))
        for stale in {"images", "plan", "shards"} - set(roles):  # an old dataset's: of another kind, or sharded
            fmt.file_path(self.prefix, stale).unlink(missing_ok=True)
        fmt.fsync_directory(Path(self.prefix).parent)
        return Path(self.prefix)

    def abort(self) -> None:
        """Close and delete the partial files (best effort: it runs while another error is on its way up)."""
        with contextlib.suppress(OSError):  # closing flushes the buffer, which fails again on a full disk
            for writer in (self.tokens, self.images, *self._index_files.values()):
                if writer is not None:
                    writer.stream.close()
        with contextlib.suppress(OSError):
            remove_partial_files(self.prefix)


def check_stored_image(image: StoredImage) -> None:
    """Refuse (``ImageError``) an image the loader cannot decode, or whose bytes are not the image its
    :class:`StoredImage` describes (what ``mmidx verify`` compares with ``image_info``): the loader decodes every
    stored image and checks its size, so either would fail every pack holding it."""
    opened, info = open_image(image.data)
    if tuple(info.record().tolist()) != image.record():
        raise ImageError(f"its bytes are a {info.width}x{info.height} {info.format} {info.mode} image "
                         f"{'with' if info.has_transparency else 'without'} transparency, but its StoredImage says "
                         f"{image.width}x{image.height} {image.format} {image.mode} "
                         f"{'with' if image.has_transparency else 'without'} transparency; describe it as "
                         "mmidx.images.decode.probe(data) finds it")
    check_decodes(opened, image.data, info)


class DatasetBuilder:
    """Append samples (multimodal) or documents (text) and finalize them into a dataset at ``prefix``.

    Use as a context manager: an exception inside the ``with`` block deletes the partial files, and
    nothing at ``prefix`` changes until :meth:`finalize` commits the complete dataset.

    Every image a sample brings is checked (:func:`check_stored_image`): one the loader cannot decode, or whose
    :class:`StoredImage` fields are not what its bytes hold, is refused with an ``ImageError`` naming the sample,
    so nothing is written that ``mmidx verify`` then fails or a pack cannot read. ``check_images=False`` skips
    the check, for images that passed it already (``mmidx build``'s sources check each one as they read it,
    counting the undecodable ones as skipped rows).
    """

    def __init__(
        self,
        prefix: str | os.PathLike,
        *,
        kind: str = "multimodal",
        vocab_size: int | None = None,
        token_dtype: np.dtype | str | None = None,
        tokenizer: dict[str, Any] | None = None,
        special_tokens: dict[str, int] | None = None,
        build_config: dict[str, Any] | None = None,
        check_images: bool = True,
    ):
        if token_dtype is None:
            if vocab_size is None:
                raise ValueError("give vocab_size (the dtype is then chosen as Megatron does) or token_dtype")
            token_dtype = fmt.token_dtype_for_vocab(vocab_size)
        self._writer = _DatasetWriter(prefix, kind, np.dtype(token_dtype))
        self.prefix = self._writer.prefix
        self.kind = kind
        self._token_limit = (np.iinfo(self._writer.token_dtype).min, np.iinfo(self._writer.token_dtype).max)
        self._meta = {"tokenizer": tokenizer, "special_tokens": special_tokens or {}, "build": build_config or {}}
        self._sources: list[str] = []
        self._source_ids: dict[str, int] = {}
        self._sequence_lengths = _Growable("<i4")
        self._document_indices = _Growable("<i8", [0])
        if kind == "multimodal":
            self._sample_view_offsets = _Growable("<i8", [0])
            self._sample_image_offsets = _Growable("<i8", [0])
            self._sample_origin = _Growable("<i8", width=2)
            self._view_element_offsets = _Growable("<i8", [0])
            self._elements = _Growable(fmt.ELEMENT_DTYPE)
            self._image_offsets = _Growable("<i8", [0])
            self._image_info = _Growable(fmt.IMAGE_DTYPE)
            self._extra_offsets = _Growable("<i8", [0])
            self._extra = bytearray()
        self._check_images = check_images
        self._finalized = False

    def __enter__(self) -> DatasetBuilder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        if exc_type is not None and not self._finalized:
            self._writer.abort()

    @property
    def num_samples(self) -> int:
        """Samples (documents) appended so far."""
        return len(self._document_indices) - 1

    def source_id(self, name: str) -> int:
        """The number ``sample_origin`` uses for the input file ``name`` (registered on first use)."""
        if name not in self._source_ids:
            self._source_ids[name] = len(self._sources)
            self._sources.append(name)
        return self._source_ids[name]

    def _checked_tokens(self, sequence: Sequence[int] | np.ndarray) -> np.ndarray:
        """One sequence as a flat array of the token dtype; ids that do not fit it are refused."""
        dtype = self._writer.token_dtype
        if isinstance(sequence, np.ndarray):
            if sequence.dtype == dtype and sequence.ndim == 1 and sequence.flags.c_contiguous:
                return sequence  # the common case, as tokenizers' arrays come
            if np.can_cast(sequence.dtype, dtype, "safe"):
                return np.ascontiguousarray(sequence.reshape(-1), dtype)  # fits by its type: nothing to check
        tokens = np.asarray(sequence, dtype=np.int64).reshape(-1)
        if tokens.size and (tokens.min() < self._token_limit[0] or tokens.max() > self._token_limit[1]):
            raise ValueError(f"token ids {tokens.min()}..{tokens.max()} do not fit {dtype}; "
                             "build with a vocab_size/token_dtype that covers the tokenizer")
        return tokens.astype(dtype)

    def _write_sequences(self, sequences: Sequence[Sequence[int] | np.ndarray]) -> None:
        checked = [self._checked_tokens(sequence) for sequence in sequences]  # all, before anything is written
        lengths = [len(tokens) for tokens in checked]
        if lengths and max(lengths) > _INT32_MAX:
            raise ValueError("a sequence longer than 2^31-1 tokens does not fit the MMIDIDX index")
        for tokens in checked:
            self._writer.tokens.write(tokens)
        self._sequence_lengths.extend(lengths)
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, sequences: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Append one document of a text dataset: its token sequences (usually exactly one)."""
        if self.kind != "text":
            raise TypeError("add_document is for text datasets; multimodal datasets take add_sample")
        self._write_sequences(sequences)

    def add_sample(
        self,
        texts: Sequence[Sequence[int] | np.ndarray],
        images: Sequence[StoredImage],
        views: Sequence[Sequence[Element]],
        origin: tuple[int, int] = (-1, -1),
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Append one multimodal sample: its token sequences, its images, and one plan per view.

        Every element's payload must name one of this sample's texts or images; ``origin`` is
        (``source_id(file)``, row) for tracing a sample back to its input; ``extra`` is optional
        JSON-serialisable per-sample data (an RL prompt's id, metadata and media references).
        """
        if self.kind != "multimodal":
            raise TypeError("add_sample is for multimodal datasets; text datasets take add_document")
        if not views:
            raise ValueError("a sample needs at least one view")
        records = [element.record() for view in views for element in view]
        text_count, image_count = len(texts), len(images)
        for kind, _, _, _, _, payload in records:
            if not 0 <= payload < (text_count if kind == fmt.TEXT else image_count):
                raise ValueError(f"an element's payload names a text or image the sample does not have "
                                 f"({text_count} texts, {image_count} images)")
        image_records = [image.record() for image in images]
        if self._check_images:
            for number, image in enumerate(images):
                try:
                    check_stored_image(image)
                except ImageError as error:
                    raise ImageError(f"image {number} of sample {self.num_samples}: {error}") from error
        encoded = json.dumps(extra, sort_keys=True, ensure_ascii=False).encode() if extra else b""
        self._write_sequences(texts)
        image_ends, end = [], self._image_offsets.last
        for image in images:
            self._writer.images.write(image.data)
            end += len(image.data)
            image_ends.append(end)
        self._image_offsets.extend(image_ends)
        self._image_info.extend(image_records)
        self._sample_image_offsets.append(self._sample_image_offsets.last + image_count)
        view_ends, end = [], self._view_element_offsets.last
        for view in views:
            end += len(view)
            view_ends.append(end)
        self._view_element_offsets.extend(view_ends)
        self._sample_view_offsets.append(self._sample_view_offsets.last + len(views))
        self._elements.extend(records)
        self._sample_origin.append(tuple(origin))
        self._extra += encoded
        self._extra_offsets.append(len(self._extra))

    def finalize(self) -> Path:
        """Write the index, plan and metadata and make the dataset visible atomically; returns the prefix."""
        if self._finalized:
            raise RuntimeError("this builder was already finalized")
        lengths = self._sequence_lengths.array()
        plan = None
        counts = {"samples": self.num_samples, "sequences": len(lengths),
                  "tokens": int(lengths.sum(dtype=np.int64))}
        if self.kind == "multimodal":
            plan = {
                "sample_view_offsets": self._sample_view_offsets.array(),
                "sample_image_offsets": self._sample_image_offsets.array(),
                "sample_origin": self._sample_origin.array(),
                "view_element_offsets": self._view_element_offsets.array(),
                "elements": self._elements.array(),
                "image_offsets": self._image_offsets.array(),
                "image_info": self._image_info.array(),
            }
            if len(self._extra):
                plan.update(sample_extra_offsets=self._extra_offsets.array(),
                            sample_extra=np.frombuffer(bytes(self._extra), dtype=np.uint8))
            counts.update(views=len(plan["view_element_offsets"]) - 1, elements=len(plan["elements"]),
                          images=len(plan["image_info"]), image_bytes=int(plan["image_offsets"][-1]))
        meta = {**self._meta, "sources": self._sources, "counts": counts}
        path = self._writer.commit(lengths, self._document_indices.array(), plan, meta)
        self._finalized = True
        return path
