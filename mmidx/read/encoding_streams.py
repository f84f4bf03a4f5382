"""Read and write precached encoding streams (``P.enc.NAME.*``, specified in :mod:`mmidx.format`).

A stream is opened once per process and read by (item, img_num) in O(log n) with zero-copy torch
views of the mapped ``.bin``; every offset, shape and size a view is made from is checked first.
Beside a dataset in object storage, the JSON and the ``.idx`` are downloaded once into the cache
(checked against the JSON's checksums) and the ``.bin`` is read by byte range
(:class:`~mmidx.io.remote_file.RemoteFile`, served from chunks the pack prefetcher fetched ahead).
"""

from __future__ import annotations

import glob
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch

from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.images.transform import ImageTransform
from mmidx.io.block_cache import FileKey
from mmidx.io.cache_folder import CacheSettings
from mmidx.io.remote_file import RemoteFile, require_cached
from mmidx.io.small_files import checked_copy, last_opened
from mmidx.io.storage import (
    StorageError,
    cache_root,
    download,
    filesystem,
    hash_object,
    is_remote,
    join,
    list_objects,
    object_size,
    retrying,
    upload,
)

ENCODING_FORMAT = "mmidx-encoding"
# --dtype names → (torch dtype, the JSON's name); bf16 is stored as its raw 16 bits.
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STORES = ("moments", "mean", "sample", "tensor")
MODALITIES = ("image", "text")
MAX_DIM = 2**31 - 1
IMG_NUM_RULE = "BAGEL: max_pixels // img_num"


def stream_version(text_input: bool) -> int:
    """The version a stream is written with: the lowest that describes it (2 only for text-input records)."""
    return 2 if text_input else 1


def stream_location(prefix: str | os.PathLike, name: str, role: str) -> str:
    """The path or URI (query options kept) of the file ``role`` of stream ``name`` beside dataset ``prefix``."""
    prefix = os.fspath(prefix)
    if not is_remote(prefix):
        return str(fmt.encoding_path(prefix, name, role))
    fmt.encoding_path("p", name, role)  # the name check
    return join(prefix, f".enc.{name}.{role}", separator="")


def write_table(path: Path, records: np.ndarray, version: int = 1) -> None:
    """Write the ``.idx`` table (records sorted by (item, img_num)) and fsync it."""
    with open(path, "wb") as stream:
        stream.write(fmt.ENCODING_MAGIC + struct.pack("<QQ", version, len(records)))
        stream.write(np.ascontiguousarray(records, fmt.ENCODING_RECORD).tobytes())
        stream.flush()
        os.fsync(stream.fileno())


def read_json(path: Path, where: str | None = None) -> dict[str, Any]:
    """The stream's metadata, refused unless it parses, checks itself, is canonical and has the fields readers use
    (errors name ``where``, the file as the user knows it, when it was downloaded to ``path``)."""
    try:
        return _read_json(path)
    except FormatError as error:
        if where is None:
            raise
        raise StorageError(str(error).replace(str(path), where)) from None


def _is_transform(args: Any) -> bool:
    """Whether ``args`` describes an image transform (what a precache records of the one it fed its encoder)."""
    try:
        ImageTransform.from_args(args)
    except (TypeError, ValueError):  # not a mapping, unknown or missing fields, values of the wrong type or range
        return False
    return True


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
        meta = json.loads(raw.decode("utf-8"))
    except OSError as error:
        raise FormatError(f"{path}: cannot read the encoding metadata ({error.strerror})") from error
    except (ValueError, RecursionError) as error:
        raise FormatError(f"{path}: the encoding metadata is not valid JSON ({error}): corrupted") from error
    if not isinstance(meta, dict) or meta.get("format") != ENCODING_FORMAT:
        raise FormatError(f"{path}: not mmidx encoding metadata (no \"format\": \"{ENCODING_FORMAT}\")")
    if fmt.sign_metadata(meta)["meta_sha256"] != meta.get("meta_sha256") or raw != fmt.serialize_metadata(meta):
        raise FormatError(f"{path}: the encoding metadata fails its own checksum or was edited: corrupted")
    version = meta.get("format_version")
    if type(version) is not int or not 1 <= version <= fmt.ENCODING_VERSION:
        raise FormatError(f"{path}: encoding format version {version!r}; this mmidx reads 1 to "
                          f"{fmt.ENCODING_VERSION} (upgrade mmidx for newer ones)")
    def one_of(key: str, choices: Any) -> bool:
        return isinstance(meta.get(key), str) and meta[key] in choices

    def optional(key: str, kind: type) -> bool:
        return meta.get(key) is None or isinstance(meta[key], kind)

    checks = {"modality": one_of("modality", MODALITIES), "store": one_of("store", STORES),
              "dtype": one_of("dtype", DTYPES), "dataset": isinstance(meta.get("dataset"), dict),
              "transform": optional("transform", str),
              "transform_args": meta.get("transform_args") is None or _is_transform(meta["transform_args"]),
              "img_num_rule": optional("img_num_rule", str),
              "input": meta.get("input") == ("text" if version == 2 else None) and (
                  version == 1 or meta.get("modality") == "text"),
              "files": isinstance(meta.get("files"), dict) and all(
                  isinstance(meta["files"].get(role), dict) and type(meta["files"][role].get("bytes")) is int
                  for role in ("bin", "idx"))}
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        raise FormatError(f"{path}: encoding metadata fields {bad} are missing or malformed: corrupted")
    return meta


def _map(path: Path, expected: int, where: str | None = None) -> mmap.mmap | bytes:
    """``path`` mapped copy-on-write (torch views need a writable buffer; nothing is ever written back)."""
    try:
        with open(path, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            if size != expected:
                raise FormatError(f"{where or path}: {size} bytes, its metadata says {expected}: truncated or replaced")
            return mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    except OSError as error:
        raise FormatError(f"{where or path}: cannot open ({error.strerror}): the encoding is incomplete") from error


def _fetched_table(prefix: str, name: str,
                   settings: CacheSettings | None = None) -> tuple[dict[str, Any], Path, RemoteFile]:
    """A remote stream's checked metadata (downloaded and kept in the cache; offline, the copy last downloaded), its
    ``.idx`` in the cache, checked at every open (:func:`~mmidx.io.small_files.checked_copy`), and its ``.bin`` as a
    byte source (through the data cache of ``settings``)."""
    json_uri, idx_uri, bin_uri = (stream_location(prefix, name, role) for role in ("json", "idx", "bin"))
    root, offline = cache_root(None if settings is None else settings.folder), settings is not None and settings.offline
    if offline:
        meta = read_json(last_opened(json_uri, root, "encoding.json") / "encoding.json")
    else:
        (root / "incoming").mkdir(parents=True, exist_ok=True)
        fresh = root / "incoming" / f"{os.getpid()}.{name}.enc.json"
        try:
            try:
                download(json_uri, fresh)
            except StorageError as error:
                if "no such object" not in str(error):
                    raise
                raise FormatError(f"{json_uri}: missing: no precached encoding {name!r} for {prefix} "
                                  f"(run `mmidx precache {prefix} --name {name} ...`)") from None
            meta = read_json(fresh, json_uri)
            (root / meta["meta_sha256"]).mkdir(exist_ok=True)
            os.replace(fresh, root / meta["meta_sha256"] / "encoding.json")  # what an offline open reads
            if not (root / meta["meta_sha256"] / "uri").exists():
                (root / meta["meta_sha256"] / "uri").write_text(json_uri)
        finally:
            fresh.unlink(missing_ok=True)
    table = root / meta["meta_sha256"] / "encoding.idx"
    checked_copy(idx_uri, meta["files"]["idx"], table, offline, remedy="precache it again")
    size = meta["files"]["bin"]["bytes"] if offline else object_size(bin_uri)
    if size != meta["files"]["bin"]["bytes"]:
        raise StorageError(f"{bin_uri}: {size} bytes, its metadata records {meta['files']['bin']['bytes']}: the upload "
                           "did not finish or the object was replaced; precache it again")
    values = RemoteFile(bin_uri, size, FileKey(meta["meta_sha256"], "bin", bin_uri, prefix, size), settings)
    if offline:
        require_cached(values)
    return meta, table, values


def upload_stream(local: str | os.PathLike, prefix: str, name: str) -> None:
    """Copy the finished stream ``name`` built beside the local ``local`` to beside the remote dataset ``prefix``:
    the old stream's JSON deleted first, then the data files, the JSON last (no copy stopped midway opens)."""
    json_uri = stream_location(prefix, name, "json")
    fs, path = filesystem(json_uri)
    if retrying(json_uri, lambda: fs.get_file_info(path)).type != pafs.FileType.NotFound:
        retrying(json_uri, lambda: fs.delete_file(path))
    for role in fmt.ENCODING_ROLES:  # data first, metadata last
        upload(fmt.encoding_path(local, name, role), stream_location(prefix, name, role))


@dataclass
class EncodingStream:
    """One opened stream: its metadata, record table and mapped values."""

    prefix: str
    name: str
    meta: dict[str, Any]
    records: np.ndarray
    keys: np.ndarray  # item * 2**32 + img_num, sorted: what lookups search
    values: Any

    @classmethod
    def open(cls, prefix: str | os.PathLike, name: str, dataset_checksum: str | None = None,
             settings: CacheSettings | None = None) -> EncodingStream:
        """Open ``P.enc.NAME``; refuse it if any file is inconsistent or (given) it was computed from other data.
        ``settings``: where a remote stream's files are cached."""
        prefix = os.fspath(prefix)
        json_path, idx_path = (stream_location(prefix, name, role) for role in ("json", "idx"))
        values: Any
        if is_remote(prefix):
            meta, local_table, values = _fetched_table(prefix, name, settings)
        else:
            if not Path(json_path).exists():
                raise FormatError(f"{json_path}: missing: no precached encoding {name!r} for {prefix} "
                                  f"(run `mmidx precache {prefix} --name {name} ...`)")
            meta, local_table = read_json(Path(json_path)), Path(idx_path)
            values = _map(Path(stream_location(prefix, name, "bin")), meta["files"]["bin"]["bytes"])
        recorded = meta["dataset"].get("checksum")
        if dataset_checksum is not None and recorded != dataset_checksum:
            raise FormatError(f"{json_path}: computed from another version of {prefix} (dataset checksum "
                              f"{recorded!r}, the dataset's is {dataset_checksum!r}): precache it again")
        table = _map(local_table, meta["files"]["idx"]["bytes"], idx_path)
        size = len(table)
        if size < fmt.ENCODING_HEADER_SIZE or bytes(table[:8]) != fmt.ENCODING_MAGIC:
            raise FormatError(f"{idx_path}: not an mmidx encoding table (magic or size): corrupted")
        version, count = struct.unpack_from("<QQ", table, 8)
        if version != meta["format_version"]:
            raise FormatError(f"{idx_path}: encoding table version {version}, its JSON says {meta['format_version']}: "
                              "corrupted or mixed with another stream's files")
        if count != (size - fmt.ENCODING_HEADER_SIZE) / fmt.ENCODING_RECORD.itemsize:
            raise FormatError(f"{idx_path}: {count} records do not fill the file ({size} bytes): truncated or "
                              "corrupted")
        records = np.frombuffer(table, fmt.ENCODING_RECORD, count, fmt.ENCODING_HEADER_SIZE)
        where = f"{idx_path}: "
        img_num = records["img_num"].astype(np.int64)
        if count and (records["item"].min() < 0 or img_num.min() < 0 or records["item"].max() >= 2**31):
            raise FormatError(where + "a record names a negative or impossible item or img_num: corrupted")
        keys = records["item"] * 2**32 + img_num
        if count and np.any(np.diff(keys) <= 0):
            raise FormatError(where + "records are not sorted by (item, img_num), each once: corrupted")
        return cls(prefix, name, meta, records, keys, values)

    def __post_init__(self) -> None:
        self.dtype: torch.dtype = DTYPES[self.meta["dtype"]]
        self.itemsize = torch.empty(0, dtype=self.dtype).element_size()

    def find(self, item: int, img_num: int) -> int | None:
        """The record number of (item, img_num), or None."""
        key = item * 2**32 + img_num
        keys = self.keys
        position = int(keys.searchsorted(key))
        return position if position < len(keys) and keys[position] == key else None

    def tensor(self, item: int, img_num: int = 1) -> torch.Tensor:
        """The stored value of (item, img_num) as a zero-copy tensor (moments: (2, C, h, w) = mean, log-variance)."""
        number = self.find(item, img_num)
        if number is None:
            raise FormatError(f"{stream_location(self.prefix, self.name, 'idx')}: no record for item {item} "
                              f"with img_num {img_num}: the encoding does not cover this data; precache it again")
        return self.view(number)

    def view(self, number: int) -> torch.Tensor:
        """Record ``number``'s value, after checking its offset, shape and size against the ``.bin``."""
        _, _, ndim, dims, offset, nbytes = self.records[number].item()  # one tuple: faster than field reads
        shape = tuple(dims[: max(0, min(ndim, 4))].tolist())
        itemsize = self.itemsize
        if not 1 <= ndim <= 4 or min(shape) < 0 or max(shape) > MAX_DIM or nbytes != math.prod(shape) * itemsize \
                or offset < 0 or offset % fmt.ENCODING_ALIGNMENT or offset > len(self.values) - nbytes:
            raise FormatError(f"{stream_location(self.prefix, self.name, 'idx')}: record {number} (shape {shape}, "
                              f"{nbytes} bytes at {offset}) does not fit {self.name}.bin "
                              f"({len(self.values)} bytes): corrupted")
        if nbytes == 0:
            return torch.zeros(shape, dtype=self.dtype)
        if isinstance(self.values, RemoteFile):  # one ranged read (or a prefetched chunk), copied once
            return torch.frombuffer(bytearray(self.values[offset:offset + nbytes]), dtype=self.dtype).view(shape)
        return torch.frombuffer(self.values, dtype=self.dtype, count=nbytes // itemsize, offset=offset).view(shape)


def open_stream(dataset: Any, name: str) -> EncodingStream:
    """The stream ``name`` of ``dataset`` (an :class:`~mmidx.read.dataset.MMIDXDataset`), opened once per opening
    of the dataset (and so in each worker process)."""
    opened = dataset._files.encodings
    if name not in opened:
        opened[name] = EncodingStream.open(dataset.prefix, name, dataset.checksum, dataset.cache)
    return opened[name]


def encoding_names(prefix: str | os.PathLike) -> list[str]:
    """The names of the precached encodings beside the dataset at ``prefix`` (those with a JSON)."""
    prefix = os.fspath(prefix)
    if is_remote(prefix):
        base, mark, query = prefix.partition("?")
        folder, _, stem = base.rstrip("/").rpartition("/")
        names = [name for name in list_objects(f"{folder}{mark}{query}") if "/" not in name]
    else:
        stem = Path(prefix).name
        names = [entry.name for entry in Path(prefix).parent.glob(f"{glob.escape(stem)}.enc.*.json")]
    start, end = f"{stem}.enc.", ".json"
    return sorted(name[len(start):-len(end)] for name in names
                  if name.startswith(start) and name.endswith(end) and "." not in name[len(start):-len(end)])


def incomplete_encodings(prefix: str | os.PathLike) -> list[str]:
    """Names of encodings beside a local dataset with a ``.bin`` or ``.idx`` but no JSON (an interrupted
    precache, or a deleted file): a job configured to read one fails, so ``verify`` reports them."""
    prefix = os.fspath(prefix)
    if is_remote(prefix):
        return []
    stem, complete = Path(prefix).name, set(encoding_names(prefix))
    start = f"{stem}.enc."
    found = {entry.name[len(start):].rpartition(".")[0]
             for suffix in ("bin", "idx") for entry in Path(prefix).parent.glob(f"{glob.escape(stem)}.enc.*.{suffix}")}
    return sorted(name for name in found if name and "." not in name and name not in complete)


def stream_records(dataset: Any, modality: str, transform: str | None) -> tuple[np.ndarray, np.ndarray]:
    """The (item, img_num) records a stream of ``modality`` (``transform`` "vae" or "vit" for images) holds:
    each distinct (image, img_num) of the element kind, or each text sequence a text element uses, sorted.
    ``mmidx precache`` computes these; ``verify`` checks a stream has every one. Needs a checked structure."""
    plan = dataset.plan
    samples = dataset.element_samples()
    if modality == "text":
        documents = np.asarray(dataset.tokens.document_indices, dtype=np.int64)
        if plan is None:
            items = np.arange(int(documents[-1]), dtype=np.int64)
        else:
            texts = plan["elements"]["kind"] == fmt.TEXT
            items = np.unique(documents[samples[texts]] + plan["elements"]["payload"][texts])
        return items, np.zeros(len(items), dtype=np.int64)
    kind = fmt.VAE_IMAGE if transform == "vae" else fmt.VIT_IMAGE
    chosen = plan["elements"]["kind"] == kind
    images = plan["sample_image_offsets"][samples[chosen]] + plan["elements"]["payload"][chosen]
    pairs = np.unique(np.stack([images, plan["elements"]["img_num"][chosen].astype(np.int64)], axis=1), axis=0)
    pairs = pairs.reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def stream_problems(dataset: Any, name: str) -> list[str]:
    """Every problem of the stream ``name`` of ``dataset``: checksums of both files, and every record's bounds."""
    try:
        stream = EncodingStream.open(dataset.prefix, name, dataset.checksum)
    except FormatError as error:
        return [str(error)]
    problems = []
    remote = is_remote(dataset.prefix)
    for role in ("bin", "idx"):
        path = stream_location(dataset.prefix, name, role)
        entry = stream.meta["files"][role]
        algorithm = next((a for a in fmt.FILE_HASHES if a in entry), None)
        if algorithm is None or (hash_object(path, algorithm) if remote else fmt.hash_file(path, algorithm)) != \
                entry[algorithm]:
            problems.append(f"{path}: checksum differs from {name}.json: modified or corrupted")
    records, itemsize = stream.records, stream.itemsize
    ndim = records["ndim"].astype(np.int64)
    dims = np.where(np.arange(4) < ndim[:, None], records["shape"].astype(np.int64), 1)
    ends = records["offset"].astype(np.float64) + records["nbytes"]  # float: a corrupted pair cannot wrap around
    bad = (ndim < 1) | (ndim > 4) | np.any(dims < 0, axis=1) | (records["offset"] < 0) | \
        (records["offset"] % fmt.ENCODING_ALIGNMENT != 0) | (records["nbytes"] < 0) | (ends > len(stream.values))
    sizes = np.prod(np.clip(dims, 0, MAX_DIM).astype(np.float64), axis=1) * itemsize  # float: no overflow
    bad |= sizes != records["nbytes"]
    if np.any(bad):
        problems.append(f"{stream_location(dataset.prefix, name, 'idx')}: {int(np.count_nonzero(bad))} records "
                        f"(first: {int(np.flatnonzero(bad)[0])}) do not fit their shape or the .bin: corrupted")
    if dataset.plan is not None or stream.meta["modality"] == "text":
        try:
            dataset.check_structure()
        except FormatError:
            return problems  # reported by verify's structure check; coverage is computed from the plan
        items, img_nums = stream_records(dataset, stream.meta["modality"], stream.meta.get("transform"))
        missing = ~np.isin(items * 2**32 + img_nums, stream.keys)
        if np.any(missing):
            first = int(np.argmax(missing))
            problems.append(f"{stream_location(dataset.prefix, name, 'idx')}: no record for {int(missing.sum())} "
                            f"of the {len(items)} (item, img_num) the dataset uses (first: item {int(items[first])} "
                            f"with img_num {int(img_nums[first])}): the encoding does not cover this data; "
                            "precache it again")
    return problems


def describe(dataset: Any, name: str) -> dict[str, Any]:
    """What ``mmidx inspect`` shows of a stream: what it holds and how it was made."""
    stream = EncodingStream.open(dataset.prefix, name, dataset.checksum)
    meta = stream.meta
    return {"name": name, "modality": meta["modality"], "transform": meta.get("transform"),
            "encoder": meta.get("encoder"), "weights_version": meta.get("weights_version"), "store": meta["store"],
            "dtype": meta["dtype"], "records": len(stream.records),
            "bytes": meta["files"]["bin"]["bytes"] + meta["files"]["idx"]["bytes"]}
