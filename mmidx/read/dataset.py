"""Random access to an mmidx dataset, or to any Megatron ``.idx``/``.bin`` pair, by sample number.

Opening maps the files and checks, in O(1), that they are complete and belong together
(:mod:`mmidx.format`); every array handed out afterwards is a read-only view of the mapped files.
A dataset pickles as its prefix and maps its files again, lazily, in the process that unpickles it
(a DataLoader worker), so no mapping or file handle ever crosses a fork or a pickle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mmidx import format as fmt
from mmidx._reader import ImageTable, TokenStream, map_readonly
from mmidx.format import FormatError
from mmidx.io.cache_folder import CacheSettings, cache_settings
from mmidx.io.remote_file import RemoteFile, remote_dataset
from mmidx.io.storage import is_remote
from mmidx.read.invariants import (
    _check_counts,
    _check_file_sizes,
    _check_plan,
    decode_extra,
    element_problem,
    structure_problems,
)


class ImageRecord(NamedTuple):
    """A stored image: its encoded bytes (zero-copy) and what was probed at build time."""

    data: memoryview
    width: int
    height: int
    format: str
    mode: str
    has_transparency: bool


@dataclass
class _Mapped:
    """Everything a dataset maps when it is opened."""

    meta: dict[str, Any] | None
    tokens: TokenStream
    plan: dict[str, np.ndarray] | None
    images: memoryview | None
    image_table: ImageTable | None
    structure_checked: bool = False
    encodings: dict[str, Any] = field(default_factory=dict)  # precached encoding streams opened, by name
    remote: dict[str, RemoteFile] = field(default_factory=dict)  # data files read by byte range, by role


def _open(prefix: str, cache: CacheSettings, known: str | None = None) -> _Mapped:
    if is_remote(prefix):  # small files cached and checked locally, data files read by byte range
        meta, local, remote = remote_dataset(prefix, cache, known)
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
        _check_file_sizes(prefix, meta)
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
    return _Mapped(meta, tokens, plan, images, image_table, remote=remote)


class Sample:
    """One sample of a dataset: its texts and images (zero-copy views) and the plan of each view."""

    __slots__ = ("_dataset", "_files", "index")

    def __init__(self, dataset: MMIDXDataset, index: int, files: _Mapped | None = None):
        self._dataset = dataset
        self._files = dataset._files if files is None else files  # the mapped files, without a property per read
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return Sample, (self._dataset, self.index)  # the dataset pickles as its prefix, the mapped files do not

    @property
    def dataset(self) -> MMIDXDataset:
        """The dataset the sample belongs to."""
        return self._dataset

    def __repr__(self) -> str:
        return (f"Sample({self.index}, views={self.num_views}, texts={self.num_texts}, "
                f"images={self.num_images})")

    def _range(self, name: str, number: int, limit: int) -> tuple[int, int]:
        """Entries ``number`` and ``number + 1`` of the offsets array ``name``, checked to be an
        ordered range inside ``[0, limit]`` before anything is read with them."""
        offsets = self._dataset.plan[name]
        start, end = int(offsets[number]), int(offsets[number + 1])
        if not 0 <= start <= end <= limit:
            raise FormatError(f"{self._dataset.prefix}.plan: {name}[{number}:{number + 2}] = [{start}, {end}] is "
                              f"not a range inside [0, {limit}] (sample {self.index}): corrupted")
        return start, end

    @property
    def num_texts(self) -> int:
        start, end = self._files.tokens.document_range(self.index)
        return end - start

    @property
    def num_images(self) -> int:
        table = self._files.image_table
        return 0 if table is None else table.count(self.index)

    @property
    def num_views(self) -> int:
        plan = self._dataset.plan
        if plan is None:
            return 1
        start, end = self._range("sample_view_offsets", self.index, len(plan["view_element_offsets"]) - 1)
        if start == end:
            raise FormatError(f"{self._dataset.prefix}.plan: sample {self.index} has no view: corrupted")
        return end - start

    def text(self, j: int) -> np.ndarray:
        """Token ids of the sample's text ``j`` (a read-only view of the mapped ``.bin``)."""
        return self._files.tokens.document_text(self.index, j)

    @property
    def texts(self) -> list[np.ndarray]:
        """Token ids of all the sample's texts."""
        return self._files.tokens.document_texts(self.index)

    def image(self, j: int) -> ImageRecord:
        """The sample's image ``j``: encoded bytes (a view of ``P.images``) and probed size, format, mode."""
        table = self._files.image_table
        if table is None:
            raise IndexError(f"image {j} out of range: sample {self.index} has 0 images")
        return table.image(self.index, j)

    def encoding(self, name: str, payload: int, img_num: int = 1) -> Any:
        """The precached encoding ``name`` of the sample's image (or text) ``payload``, as a zero-copy
        torch tensor: (C, h, w), or (2, C, h, w) moments (mean, log-variance), (h, w, D) tokens of a ViT
        stream (``--transform vit``), or (L, D) for a text ((n, D) from an encoder that read its string).
        A stream beside a dataset in object storage is read by byte range."""
        from mmidx.read.encoding_streams import open_stream

        stream = open_stream(self._dataset, name)
        if stream.meta["modality"] == "text":
            first, end = self._files.tokens.document_range(self.index)
            count, img_num = end - first, 0
        else:
            first, end = self._range("sample_image_offsets", self.index, len(self._dataset.plan["image_info"])) \
                if self._dataset.plan is not None else (0, 0)
            count = end - first
        if not 0 <= payload < count:
            raise IndexError(f"{name}: payload {payload} out of range: sample {self.index} has {count}")
        return stream.tensor(first + payload, img_num)

    @property
    def images(self) -> list[ImageRecord]:
        """All the sample's images."""
        return [self.image(j) for j in range(self.num_images)]

    def elements(self, view: int = 0) -> np.ndarray:
        """The plan of one view as ``ELEMENT_DTYPE`` records (a view of ``P.plan`` for multimodal data).

        Text datasets (and Megatron files) have one implied view: a text element with loss per sequence.
        """
        if not 0 <= view < self.num_views:
            raise IndexError(f"view {view} out of range: sample {self.index} has {self.num_views} views")
        plan = self._dataset.plan
        if plan is None:
            records = np.zeros(self.num_texts, dtype=fmt.ELEMENT_DTYPE)
            records["flags"] = fmt.FLAG_LOSS | fmt.FLAG_SPLIT_START | fmt.FLAG_SPLIT_END
            records["img_num"] = 1
            records["special_token_label"] = -1
            records["payload"] = np.arange(self.num_texts)
            return records
        number = int(plan["sample_view_offsets"][self.index]) + view  # checked by num_views
        start, end = self._range("view_element_offsets", number, len(plan["elements"]))
        records = plan["elements"][start:end]
        problem = element_problem(records, self.num_texts, self.num_images)
        if problem:
            raise FormatError(f"{self._dataset.prefix}.plan: view {view} of sample {self.index}: {problem}: corrupted")
        return records

    def sequence_plan(self, view: int = 0) -> list[dict[str, Any]]:
        """The plan of one view in BAGEL's ``sequence_plan`` shape (dicts), with each element's payload."""
        plan = []
        for record in self.elements(view):
            flags, label = int(record["flags"]), int(record["special_token_label"])
            item = {
                "type": fmt.KIND_NAMES[record["kind"]],
                "enable_cfg": int(bool(flags & fmt.FLAG_ENABLE_CFG)),
                "loss": int(bool(flags & fmt.FLAG_LOSS)),
                "special_token_loss": int(bool(flags & fmt.FLAG_SPECIAL_TOKEN_LOSS)),
                "special_token_label": None if label < 0 else label,
                "split_start": bool(flags & fmt.FLAG_SPLIT_START),
                "split_end": bool(flags & fmt.FLAG_SPLIT_END),
                "img_num": int(record["img_num"]),
                "payload": int(record["payload"]),
            }
            if flags & fmt.FLAG_HAS_FRAME_DELTA:
                item["frame_delta"] = int(record["frame_delta"])
            plan.append(item)
        return plan

    @property
    def extra(self) -> dict[str, Any]:
        """Per-sample JSON data the builder stored (e.g. an RL prompt's id and metadata); {} if none."""
        plan = self._dataset.plan
        if plan is None or "sample_extra" not in plan:
            return {}
        start, end = self._range("sample_extra_offsets", self.index, len(plan["sample_extra"]))
        if start == end:
            return {}
        extra, problem = decode_extra(plan["sample_extra"][start:end].tobytes())
        if problem:
            raise FormatError(f"{self._dataset.prefix}.plan: extra data of sample {self.index} is {problem}: "
                              "corrupted")
        return extra

    @property
    def origin(self) -> tuple[str | None, int]:
        """(input file, row) the sample was built from, when the builder recorded it."""
        plan = self._dataset.plan
        if plan is None:
            return None, -1
        source, row = (int(v) for v in plan["sample_origin"][self.index])
        sources = (self._dataset.metadata or {}).get("sources", [])
        return (sources[source] if 0 <= source < len(sources) else None), row


class MMIDXDataset:
    """An opened dataset: ``len()`` samples, ``ds[i]`` → :class:`Sample`, and token-level random access.

    ``prefix`` names the files (``prefix.idx``, ``prefix.bin``, ...). A Megatron ``.idx``/``.bin``
    pair without mmidx metadata opens as a text dataset whose samples are Megatron's documents.
    A dataset in object storage caches its small files in ``cache_dir`` and, given ``cache_limit`` (bytes, or
    ``"500G"``), its data in blocks there too, shared by the node's processes (:mod:`mmidx.io.block_cache`);
    ``$MMIDX_CACHE_DIR`` and ``$MMIDX_CACHE_LIMIT`` stand for them (:func:`~mmidx.io.cache_folder.cache_settings`).
    """

    def __init__(self, prefix: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None):
        self.prefix, self.cache = os.fspath(prefix), cache_settings(cache_dir, cache_limit)
        self._mapped: _Mapped | None = _open(self.prefix, self.cache)

    def __getstate__(self) -> dict[str, Any]:  # a remote dataset's worker reads the version its parent opened
        known = self._mapped.meta["meta_sha256"] if self._mapped and self._mapped.remote else None
        return {"prefix": self.prefix, "cache": self.cache, "known": getattr(self, "_known", None) or known}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prefix, self.cache, self._known, self._mapped = state["prefix"], state["cache"], state["known"], None

    @property
    def _files(self) -> _Mapped:
        if self._mapped is None:
            self._mapped = _open(self.prefix, self.cache, self._known)
        return self._mapped

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
        return self._files.tokens

    @property
    def plan(self) -> dict[str, np.ndarray] | None:
        """The arrays of ``P.plan`` (None for text datasets)."""
        return self._files.plan

    @property
    def image_bytes(self) -> memoryview:
        """The mapped ``P.images`` file (empty for text datasets)."""
        images = self._files.images
        return memoryview(b"") if images is None else images

    @property
    def remote_files(self) -> dict[str, RemoteFile]:
        """The data files ("bin", "images") read by byte range from object storage (empty for local files)."""
        return self._files.remote

    @property
    def token_dtype(self) -> np.dtype:
        return self._files.tokens.dtype

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
            problems = structure_problems(self)
            if problems:
                raise FormatError(problems[0])
            files.structure_checked = True

    def element_samples(self) -> np.ndarray:
        """The sample number of every element record of ``P.plan`` (int64; empty for text datasets).

        Needs monotone offsets (:meth:`check_structure`)."""
        plan = self.plan
        if plan is None:
            return np.zeros(0, dtype=np.int64)
        views = np.repeat(np.arange(len(self), dtype=np.int64), np.diff(plan["sample_view_offsets"]))
        return np.repeat(views, np.diff(plan["view_element_offsets"]))

    def __len__(self) -> int:
        return self._files.tokens.document_count

    def __getitem__(self, index: int) -> Sample:
        files = self._mapped  # not the property: a random sample's read is a few hundred nanoseconds
        if files is None:
            files = self._files
        count = files.tokens.document_count
        if type(index) is not int:
            if not isinstance(index, (int, np.integer)):
                raise TypeError(f"samples are indexed by integers, not {type(index).__name__}")
            index = int(index)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"sample {index} out of range for {count} samples")
        return Sample(self, index, files)

    def get_tokens(self, sequence: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of a sequence, bounds-checked, as a zero-copy view."""
        return self._files.tokens.get(sequence, offset, length)

    def gather(self, sequences: np.ndarray, offsets: np.ndarray | None = None,
               lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copy many sequences (or spans of them) into one contiguous array in a single call.

        Returns ``(tokens, bounds)``; span i is ``tokens[bounds[i]:bounds[i + 1]]``.
        """
        return self._files.tokens.gather(sequences, offsets, lengths)

    def __repr__(self) -> str:
        return f"MMIDXDataset({self.prefix!r}, kind={self.kind}, samples={len(self)})"


def dataset_files(prefix: str | os.PathLike) -> list[Path]:
    """The files that make up the dataset at ``prefix`` and exist on disk."""
    return [path for role in fmt.SUFFIXES if (path := fmt.file_path(prefix, role)).exists()]
