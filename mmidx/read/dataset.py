"""Random access to an mmidx dataset, or to any Megatron ``.idx``/``.bin`` pair, by sample number.

Opening maps the files and checks, in O(1), that they are complete and belong together
(:mod:`mmidx.format`); every array handed out afterwards is a read-only view of the mapped files.
A dataset pickles as its prefix and maps its files again, lazily, in the process that unpickles it
(a DataLoader worker), so no mapping or file handle ever crosses a fork or a pickle.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx._reader import ImageTable, TokenStream, map_readonly
from mmidx.errors import MMIDXError
from mmidx.format import FormatError
from mmidx.io.cache_folder import CacheSettings, cache_settings
from mmidx.io.remote_file import RemoteFile, remote_dataset
from mmidx.io.storage import file_uri, is_remote
from mmidx.read.invariants import (
    _check_counts,
    _check_file_sizes,
    _check_plan,
    structure_problems,
)
from mmidx.read.mapped import MAPPED
from mmidx.read.sample import ImageRecord, Sample
from mmidx.read.shards import Part, ShardTable


class WholeArraysError(MMIDXError, TypeError):
    """A sharded dataset was asked for an array of the whole dataset, which only a dataset of one set of files
    has."""


@dataclass
class _Mapped:
    """Everything a dataset maps when it is opened (a sharded dataset: its shard table alone)."""

    meta: dict[str, Any] | None
    tokens: TokenStream | None  # None for a sharded dataset, as are plan, images and image_table
    plan: dict[str, np.ndarray] | None
    images: memoryview | None
    image_table: ImageTable | None
    count: int  # samples
    shards: ShardTable | None = None
    structure_checked: bool = False
    encodings: dict[str, Any] = field(default_factory=dict)  # precached encoding streams opened, by name
    remote: dict[str, RemoteFile] = field(default_factory=dict)  # data files read by byte range, by role


def _open(prefix: str, cache: CacheSettings, known: str | None = None) -> _Mapped:
    """Map the dataset at ``prefix``; ``known``: the metadata checksum it must have (a worker reads the version its
    parent opened; a shard, the version its table records)."""
    if is_remote(prefix):  # small files cached and checked locally, data files read by byte range
        meta, local, remote = remote_dataset(prefix, cache, known)
        if meta.get("layout") == "sharded":
            return _sharded(prefix, meta, file_uri(prefix, "shards"), map_readonly(local["shards"]), cache)
        files: dict[str, Any] = {role: map_readonly(path) for role, path in local.items() if role != "meta"}
        return _assemble(prefix, meta, local["idx"], {**files, **remote})
    meta_path, idx_path, bin_path = (fmt.file_path(prefix, role) for role in ("meta", "idx", "bin"))
    meta = fmt.read_metadata(meta_path) if meta_path.exists() else None
    if meta is None and not idx_path.exists():
        raise FormatError(f"{prefix}: no dataset here: neither {meta_path.name} nor {idx_path.name} exists")
    multimodal = [path.name for role in ("plan", "images") if (path := fmt.file_path(prefix, role)).exists()]
    if meta is None and multimodal:  # without its metadata a multimodal dataset would silently read as text only
        raise FormatError(f"{meta_path}: missing, but {' and '.join(multimodal)} beside it make this a "
                          "multimodal dataset that cannot be read without it: restore it or rebuild")
    if meta is not None:
        if known is not None and meta["meta_sha256"] != known:
            raise FormatError(f"{meta_path}: its checksum is {meta['meta_sha256'][:12]}..., not the "
                              f"{known[:12]}... it was opened as: the dataset was replaced; rebuild or reopen it")
        _check_file_sizes(prefix, meta)
        if meta.get("layout") == "sharded":
            table = fmt.file_path(prefix, "shards")
            return _sharded(prefix, meta, table, map_readonly(table), cache)
    if not bin_path.exists():
        raise FormatError(f"{bin_path}: missing; the token index {idx_path.name} has no data file")
    roles = ("idx", "bin", "plan", "images") if meta is not None and meta["kind"] == "multimodal" else ("idx", "bin")
    return _assemble(prefix, meta, idx_path, {role: map_readonly(fmt.file_path(prefix, role)) for role in roles})


def _assemble(prefix: str, meta: dict[str, Any] | None, idx_path: Path, files: dict[str, Any]) -> _Mapped:
    """The readers over a dataset's files (maps, or byte sources for data in object storage), checked
    to belong together."""
    header = fmt.read_token_index_header(idx_path)
    tokens = TokenStream(prefix, header, files["idx"], files["bin"])
    plan = images = image_table = None
    if meta is not None:
        _check_counts(prefix, meta, tokens)
        if meta["kind"] == "multimodal":
            plan = fmt.read_plan(fmt.file_path(prefix, "plan"), files["plan"])
            images = files["images"]
            _check_plan(prefix, meta, tokens, plan, len(images))
            image_table = ImageTable(prefix, plan["sample_image_offsets"], plan["image_offsets"], plan["image_info"],
                                     images, ImageRecord)
    remote = {role: file for role, file in files.items() if isinstance(file, RemoteFile)}
    return _Mapped(meta, tokens, plan, images, image_table, tokens.document_count, remote=remote)


def _sharded(prefix: str, meta: dict[str, Any], name: str | os.PathLike, table: Any, cache: CacheSettings) -> _Mapped:
    """A sharded dataset: its checked table (``name``: its path or URI, for messages), each shard opened (and
    checked against it) when first read."""
    arrays = fmt.read_shard_table(name, table, meta)
    shards = ShardTable(prefix, meta, arrays, lambda shard, digest: MMIDXDataset._opened_as(shard, cache, digest))
    return _Mapped(meta, None, None, None, None, shards.sample_count, shards=shards)


class MMIDXDataset:
    """An opened dataset: ``len()`` samples, ``ds[i]`` → :class:`Sample`, and token-level random access.

    ``prefix`` names the files (``prefix.idx``, ``prefix.bin``, ...). A Megatron ``.idx``/``.bin``
    pair without mmidx metadata opens as a text dataset whose samples are Megatron's documents.
    A dataset in object storage caches its small files in ``cache_dir`` and, given ``cache_limit`` (bytes, or
    ``"500G"``), its data in blocks there too, shared by the node's processes (:mod:`mmidx.io.block_cache`);
    ``$MMIDX_CACHE_DIR`` and ``$MMIDX_CACHE_LIMIT`` stand for them (:func:`~mmidx.io.cache_folder.cache_settings`).

    A sharded dataset (:mod:`mmidx.format`, version 2: the result of a build of many units) opens the same way and
    reads the same samples as its merge would: ``ds[i]`` is a :class:`Sample` of the shard holding sample ``i``
    (``sample.dataset`` is that shard, ``sample.index`` the sample's number there). It has no arrays of the whole
    dataset (``tokens``, ``plan``...: :class:`WholeArraysError`); :attr:`parts` gives each shard's, for every kind
    of dataset.
    """

    def __init__(self, prefix: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None):
        self.prefix, self.cache = os.fspath(prefix), cache_settings(cache_dir, cache_limit)
        self._known: str | None = None
        self._mapped: _Mapped | None = _open(self.prefix, self.cache)
        MAPPED.used(self)

    @classmethod
    def _opened_as(cls, prefix: str, cache: CacheSettings, known: str) -> MMIDXDataset:
        """The dataset at ``prefix``, refused unless its metadata's checksum is ``known`` (a shard of a table)."""
        dataset = cls.__new__(cls)
        dataset.prefix, dataset.cache, dataset._known = prefix, cache, known
        dataset._mapped = _open(prefix, cache, known)
        MAPPED.used(dataset)
        return dataset

    def __getstate__(self) -> dict[str, Any]:  # a remote dataset's worker reads the version its parent opened
        known = self._mapped.meta["meta_sha256"] if self._mapped and self._mapped.remote else None
        return {"prefix": self.prefix, "cache": self.cache, "known": getattr(self, "_known", None) or known}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prefix, self.cache, self._known, self._mapped = state["prefix"], state["cache"], state["known"], None

    @property
    def _files(self) -> _Mapped:
        mapped = self._mapped
        if mapped is None:
            mapped = self._mapped = _open(self.prefix, self.cache, self._known)
        MAPPED.used(self)
        return mapped

    def unmap(self) -> None:
        """Let go of the mapped files (they are mapped again when next read; views handed out keep theirs). A
        sharded dataset keeps its table (one small map), and so the shards it opened and checked: the shards'
        own files are what is unmapped, each by itself."""
        mapped = self._mapped
        if mapped is not None and mapped.shards is None:
            self._mapped = None

    def _single(self, what: str) -> _Mapped:
        """The mapped files, or a :class:`WholeArraysError` naming ``what`` for a sharded dataset."""
        files = self._files
        if files.shards is not None:
            raise WholeArraysError(
                f"{self.prefix} is a sharded dataset ({len(files.shards)} shards): it has no single {what}; read "
                f"samples with dataset[i], each shard's arrays through dataset.parts, or write one set of files "
                f"with `mmidx merge {self.prefix} --output NEW`")
        return files

    @property
    def is_sharded(self) -> bool:
        """Whether the dataset is a table of shards (format version 2) rather than one set of files."""
        return self._files.shards is not None

    @property
    def parts(self) -> Sequence[Part]:
        """The dataset as datasets of one set of files, in order: its shards, or the dataset itself. Whatever reads
        whole index arrays reads them a part at a time, so it works on either kind and never holds every shard's
        arrays at once."""
        files = self._files
        return files.shards if files.shards is not None else (Part(0, self),)

    @property
    def metadata(self) -> dict[str, Any] | None:
        """The parsed ``P.meta.json`` (None for a bare Megatron pair)."""
        return self._files.meta

    @property
    def kind(self) -> str:
        """"multimodal" or "text" (Megatron pairs without metadata are "text")."""
        meta = self._files.meta
        return "text" if meta is None else meta["kind"]

    @property
    def tokens(self) -> TokenStream:
        """The token stream: Megatron-style arrays and bounds-checked zero-copy reads."""
        return self._single("token stream").tokens

    @property
    def plan(self) -> dict[str, np.ndarray] | None:
        """The arrays of ``P.plan`` (None for text datasets)."""
        return self._single("plan").plan

    @property
    def image_bytes(self) -> memoryview:
        """The mapped ``P.images`` file (empty for text datasets)."""
        images = self._single("image file").images
        return memoryview(b"") if images is None else images

    @property
    def remote_files(self) -> dict[str, RemoteFile]:
        """The data files ("bin", "images") read by byte range from object storage (empty for local files)."""
        return self._single("set of data files").remote

    @property
    def token_dtype(self) -> np.dtype:
        files = self._files
        return files.tokens.dtype if files.tokens is not None else np.dtype(files.meta["token_dtype"])

    @property
    def tokenizer(self) -> dict[str, Any] | None:
        """The tokenizer identity recorded at build time."""
        return (self._files.meta or {}).get("tokenizer")

    @property
    def special_tokens(self) -> dict[str, int]:
        """Ids of BAGEL's special tokens and the end-of-document token recorded at build time."""
        return (self._files.meta or {}).get("special_tokens", {})

    @property
    def checksum(self) -> str:
        """What identifies this dataset's content, for cache keys: the metadata's own sha256, or for a
        bare Megatron pair the size and modification time of its files (rewriting them changes it)."""
        meta = self._files.meta
        if meta is not None:
            return meta["meta_sha256"]
        stats = [fmt.file_path(self.prefix, role).stat() for role in ("idx", "bin")]
        return "megatron:" + ":".join(f"{stat.st_size}:{stat.st_mtime_ns}" for stat in stats)

    def check_structure(self) -> None:
        """Raise ``FormatError`` naming the first broken O(n) invariant (:func:`structure_problems`);
        checked once per opening, before anything is sized or indexed from the whole index arrays."""
        files = self._files
        if not files.structure_checked:
            if files.shards is not None:
                for part in files.shards:
                    part.dataset.check_structure()
            elif problems := structure_problems(self):
                raise FormatError(problems[0])
            files.structure_checked = True

    def element_samples(self) -> np.ndarray:
        """The sample number of every element record of ``P.plan`` (int64; empty for text datasets).

        Needs monotone offsets (:meth:`check_structure`)."""
        plan = self._single("element table").plan
        if plan is None:
            return np.zeros(0, dtype=np.int64)
        views = np.repeat(np.arange(len(self), dtype=np.int64), np.diff(plan["sample_view_offsets"]))
        return np.repeat(views, np.diff(plan["view_element_offsets"]))

    def __len__(self) -> int:
        return self._files.count

    def __getitem__(self, index: int) -> Sample:
        files = self._mapped  # not the property: a random sample's read is a few hundred nanoseconds
        if files is None:
            files = self._files
        count = files.count
        if type(index) is not int:
            if not isinstance(index, (int, np.integer)):
                raise TypeError(f"samples are indexed by integers, not {type(index).__name__}")
            index = int(index)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"sample {index} out of range for {count} samples")
        if files.shards is not None:
            shard, local = files.shards.locate(index)
            return files.shards.shard(shard)[local]
        return Sample(self, index, files)

    def get_tokens(self, sequence: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of a sequence, bounds-checked, as a zero-copy view."""
        return self._single("token stream").tokens.get(sequence, offset, length)

    def gather(self, sequences: np.ndarray, offsets: np.ndarray | None = None,
               lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copy many sequences (or spans of them) into one contiguous array in a single call.

        Returns ``(tokens, bounds)``; span i is ``tokens[bounds[i]:bounds[i + 1]]``.
        """
        return self._single("token stream").tokens.gather(sequences, offsets, lengths)

    def __repr__(self) -> str:
        return f"MMIDXDataset({self.prefix!r}, kind={self.kind}, samples={len(self)})"


def dataset_files(prefix: str | os.PathLike) -> list[Path]:
    """The files that make up the dataset at ``prefix`` and exist on disk."""
    return [path for role in fmt.SUFFIXES if (path := fmt.file_path(prefix, role)).exists()]
