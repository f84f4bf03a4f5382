"""Datasets in object storage: ``MMIDXDataset("s3://bucket/path/prefix")`` and any URI pyarrow opens.

The small files (``.meta.json``, ``.idx``, ``.plan``) are downloaded once into a local cache folder
named by the metadata's ``meta_sha256``, checked against the checksums the metadata records, and
mapped as local files are. ``.bin`` and ``.images`` stay in storage, read by byte range through
:class:`~mmidx.io.remote_file.RemoteFile`. Query options of a URI (``?endpoint_override=...``) are kept
on every file of the dataset; ``AWS_ENDPOINT_URL`` and the usual AWS variables apply too.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pyarrow.fs as pafs

from mmidx import format as fmt
from mmidx.errors import option
from mmidx.format import FormatError
from mmidx.io.cache_folder import default_folder
from mmidx.io.files import read_json

RETRIES = 4  # attempts of a transient failure (connection reset, throttling, 5xx) before it is an error
BACKOFF_S = 0.2  # doubled after each failed attempt
_T = TypeVar("_T")


class StorageError(FormatError):
    """Object storage cannot serve a file of a dataset: the message names the URI and what to do."""


def is_remote(prefix: str | os.PathLike) -> bool:
    """Whether ``prefix`` names a dataset in object storage (a URI other than ``file://``)."""
    prefix = os.fspath(prefix)
    return "://" in prefix and not prefix.startswith("file://")


def file_uri(prefix: str, role: str) -> str:
    """The URI of the file playing ``role`` (a key of ``format.SUFFIXES``), query options kept."""
    return join(prefix, fmt.SUFFIXES[role], separator="")


def shard_location(prefix: str, number: int) -> str:
    """The prefix of shard ``number`` of the sharded dataset at ``prefix`` (:func:`mmidx.format.shard_prefix`), a
    URI's query options kept."""
    if is_remote(prefix):
        return join(prefix, fmt.shard_prefix("", number), separator="")
    return fmt.shard_prefix(prefix, number)


def join(location: str, name: str, separator: str = "/") -> str:
    """``location`` + ``separator`` + ``name``, with a URI's query (``?endpoint_override=...``) kept at the end."""
    base, mark, query = location.partition("?")
    return f"{base.rstrip('/') if separator else base}{separator}{name}{mark}{query}"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the small files of remote datasets are cached: ``remote/`` in ``cache_dir`` (a reader's), else in
    ``$MMIDX_CACHE_DIR`` or ``~/.cache/mmidx``."""
    return default_folder(cache_dir) / "remote"


_filesystems: dict[tuple[int, str, int], pafs.FileSystem] = {}
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 60.0


def _configured(fs: pafs.FileSystem, attempts: int) -> pafs.FileSystem:
    """An S3 filesystem with bounded timeouts, ``attempts`` attempts per request, and small objects written
    in one PUT; other filesystems as they are."""
    if not isinstance(fs, pafs.S3FileSystem):
        return fs
    options = fs.__reduce__()[1][0]  # the options from_uri resolved (query, AWS variables)
    options["connect_timeout"] = CONNECT_TIMEOUT_S if options["connect_timeout"] < 0 else options["connect_timeout"]
    options["request_timeout"] = REQUEST_TIMEOUT_S if options["request_timeout"] < 0 else options["request_timeout"]
    return pafs.S3FileSystem(**{**options, "allow_delayed_open": True},
                             retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=attempts))


_CREDENTIALS = re.compile(r"(?<=://)[^/?#@\s]*@")


def redact(text: str) -> str:
    """``text`` with the credentials of any URI in it (``s3://KEY:SECRET@bucket``) replaced by ``***``."""
    return _CREDENTIALS.sub("***@", text)


def filesystem(location: str, *, attempts: int = 1) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem holding ``location`` and the path in it: the one resolver of mmidx.

    ``location``: a local path, ``file://`` or any URI ``pyarrow.fs.FileSystem.from_uri`` opens (query options
    and the AWS variables apply). Remote filesystems are made once per bucket, query and process, with bounded
    timeouts and ``attempts`` attempts per S3 request (byte-range readers retry in :func:`retrying` and ask for
    1; streaming readers ask pyarrow for :data:`RETRIES`). Credentials inside a URI are refused.
    """
    if "://" not in location:
        return pafs.LocalFileSystem(), os.path.abspath(location)
    scheme, rest = location.split("://", 1)
    bucket, _, query = rest.partition("?")
    if "@" in bucket.split("/", 1)[0]:
        raise StorageError(f"{redact(location)}: credentials inside a URI are not accepted (they would be "
                           "echoed in messages and reports): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                           "(or AWS_PROFILE) and give the URI without them")
    try:
        if scheme == "file":
            return pafs.LocalFileSystem(), pafs.FileSystem.from_uri(location)[1]
        key = (os.getpid(), f"{scheme}://{bucket.split('/', 1)[0]}?{query}", attempts)
        if key not in _filesystems:
            _filesystems[key] = _configured(pafs.FileSystem.from_uri(key[1].rstrip("?"))[0], attempts)
        return _filesystems[key], pafs.FileSystem.from_uri(location)[1]
    except (ValueError, OSError) as error:  # pyarrow: ArrowInvalid (a ValueError) for a URI it cannot use
        raise StorageError(f"{location}: not a URI pyarrow's filesystems can open ({error}): check its scheme "
                           "and query options") from error


def _explain(uri: str, error: Exception) -> StorageError:
    """One line naming ``uri``, what went wrong and what to do, for a failed storage call."""
    text = " ".join(str(error).split())
    if isinstance(error, FileNotFoundError):
        fs, path = filesystem(uri)
        bucket = path.split("/", 1)[0]
        try:
            missing_bucket = fs.get_file_info(bucket).type == pafs.FileType.NotFound
        except OSError:
            missing_bucket = False
        if missing_bucket:
            return StorageError(f"{uri}: bucket {bucket!r} does not exist (or these credentials cannot see it): "
                                "check the URI")
        return StorageError(f"{uri}: no such object: check the prefix, or build/upload the dataset there")
    if any(word in text for word in ("ACCESS_DENIED", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                     "403")):
        return StorageError(f"{uri}: access denied: check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY "
                            "or AWS_PROFILE) and the bucket's permissions")
    if any(word in text for word in ("NETWORK_CONNECTION", "curlCode", "Could not connect", "Connection refused")):
        return StorageError(f"{uri}: cannot reach the storage endpoint ({text[:200]}): check AWS_ENDPOINT_URL or "
                            "the URI's endpoint_override, and the network")
    return StorageError(f"{uri}: storage request failed ({text[:300]})")


def _transient(error: Exception) -> bool:
    """Worth another attempt: anything but a missing object or refused credentials."""
    return not isinstance(error, FileNotFoundError) and "ACCESS_DENIED" not in str(error) \
        and "InvalidAccessKeyId" not in str(error)


def retrying(uri: str, call: Callable[[], _T]) -> _T:
    """``call()``, retried with exponential backoff (``RETRIES`` attempts) while it fails transiently;
    a failure that persists is a :class:`StorageError` naming ``uri``."""
    for attempt in range(RETRIES):
        try:
            return call()
        except OSError as error:
            if not _transient(error) or attempt == RETRIES - 1:
                raise _explain(uri, error) from None
            time.sleep(BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")


def object_size(uri: str) -> int:
    """The size in bytes of the object at ``uri``."""
    fs, path = filesystem(uri)

    def size() -> int:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        return info.size

    return retrying(uri, size)


def download(uri: str, target: Path) -> None:
    """Copy the object at ``uri`` to ``target`` (written beside it, then renamed: never half a file)."""
    fs, path = filesystem(uri)
    partial = target.with_name(target.name + f".partial{os.getpid()}")

    def copy() -> None:
        with fs.open_input_stream(path) as source, open(partial, "wb") as sink:
            shutil.copyfileobj(source, sink, 8 << 20)

    try:
        retrying(uri, copy)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def upload(source: Path, uri: str) -> None:
    """Copy the local file ``source`` to the object ``uri`` (an object appears whole or not at all)."""
    fs, path = filesystem(uri)

    def copy() -> None:
        with open(source, "rb") as stream, fs.open_output_stream(path) as sink:
            shutil.copyfileobj(stream, sink, 8 << 20)

    retrying(uri, copy)


def read_object(uri: str) -> bytes:
    """The whole content of the (small) object at ``uri``."""
    fs, path = filesystem(uri)

    def read() -> bytes:
        with fs.open_input_stream(path) as stream:
            return stream.read()

    return retrying(uri, read)


def list_objects(uri: str) -> list[str]:
    """Paths, relative to the folder ``uri``, of every object under it (none when it does not exist)."""
    fs, path = filesystem(uri)
    infos = retrying(uri, lambda: fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)))
    return sorted(info.path[len(path.rstrip("/")) + 1:] for info in infos if info.type == pafs.FileType.File)


def delete_folder(uri: str) -> None:
    """Delete every object under the folder ``uri`` (nothing when it does not exist)."""
    fs, path = filesystem(uri)
    for name in list_objects(uri):
        retrying(uri, lambda name=name: fs.delete_file(f"{path.rstrip('/')}/{name}"))


def cached_small_files(prefix: str, cache_dir: str | os.PathLike | None = None,
                       known: str | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Metadata of the remote dataset ``prefix`` and local copies of its small files, each checked
    against the checksum the metadata records (downloaded once into :func:`cache_root`; later opens find them
    there). ``known``: the ``meta_sha256`` another process of this job opened (a loader worker): its cached
    files are used without asking storage again."""
    root = cache_root(cache_dir)
    folder = root / (known or "?")
    if known is not None and (folder / "dataset.meta.json").exists():
        meta = fmt.read_metadata(folder / "dataset.meta.json")  # checks its own checksum
    else:
        meta, folder = _fetched_metadata(prefix, root)
    if not (folder / "uri").exists():  # which dataset it is, for `mmidx cache clear --dataset`
        (folder / "uri").write_text(prefix)
    paths = {"meta": folder / "dataset.meta.json"}
    for role in ("idx", "plan", "shards"):
        if role not in meta["files"]:
            continue
        entry, local = meta["files"][role], folder / f"dataset{fmt.SUFFIXES[role]}"
        if not local.exists():  # a cached copy was checked before it was renamed into place
            unverified = local.with_name(f"{local.name}.{os.getpid()}.{threading.get_ident()}.unverified")
            try:
                download(file_uri(prefix, role), unverified)
                algorithm = fmt.file_hash_algorithm(entry)
                if unverified.stat().st_size != entry["bytes"] or \
                        fmt.hash_file(unverified, algorithm) != entry[algorithm]:
                    raise StorageError(f"{file_uri(prefix, role)}: its {algorithm} checksum or size differs from "
                                       "the metadata: the object was replaced or corrupted; re-upload the dataset")
                os.replace(unverified, local)
            finally:
                unverified.unlink(missing_ok=True)
        paths[role] = local
    return meta, paths


def _fetched_metadata(prefix: str, root: Path) -> tuple[dict[str, Any], Path]:
    """The remote dataset's metadata, downloaded and checked, and its folder in the cache ``root``."""
    meta_uri = file_uri(prefix, "meta")
    scratch = root / "incoming"
    scratch.mkdir(parents=True, exist_ok=True)
    fresh = scratch / f"{os.getpid()}.{threading.get_ident()}.meta.json"
    try:
        download(meta_uri, fresh)
        try:
            meta = fmt.read_metadata(fresh)
        except FormatError as error:  # named as the user named it
            raise StorageError(str(error).replace(str(fresh), meta_uri)) from None
        folder = root / meta["meta_sha256"]
        folder.mkdir(parents=True, exist_ok=True)
        os.replace(fresh, folder / "dataset.meta.json")
    finally:
        fresh.unlink(missing_ok=True)
    return meta, folder


# Files in the order a copy writes them: data first, the index and metadata last, so that a copy
# stopped at any point never leaves a dataset that opens (a reader needs both). A sharded dataset's shards are
# copied before its table, each as a dataset of its own.
UPLOAD_ORDER = ("bin", "images", "plan", "shards", "idx", "meta")
FETCH_ORDER = ("bin", "images", "plan", "shards", "meta", "idx")  # locally a text .idx/.bin pair opens without meta


def remote_metadata(prefix: str) -> bytes | None:
    """The bytes of the remote dataset ``prefix``'s metadata, None when there is none (or it cannot be read)."""
    fs, meta_path = filesystem(file_uri(prefix, "meta"))
    try:
        return retrying(file_uri(prefix, "meta"), lambda: fs.open_input_stream(meta_path).read())
    except StorageError:
        return None


def shard_numbers(table: str | os.PathLike, meta: dict[str, Any]) -> list[int]:
    """The folder numbers of a sharded dataset's shards, in order, from its (local) ``P.shards.table``."""
    import numpy as np

    return fmt.read_shard_table(table, np.fromfile(table, dtype=np.uint8), meta)["shard_numbers"].tolist()


def upload_dataset(local_prefix: str | os.PathLike, prefix: str, *, shards_uploaded: bool = False) -> bool:
    """Copy the local dataset ``local_prefix`` to the remote ``prefix``; False when the same dataset
    (the same metadata) is there already. A dataset being replaced loses its metadata and index first.

    A sharded dataset's shards are copied first, each as a dataset (at :func:`shard_location`), then its table,
    its metadata last; ``shards_uploaded``: they are there already (a build uploads each as it finishes: a reader
    checks every shard against the table when it opens it, so one that is not the table's is refused, never read)."""
    meta_bytes = fmt.file_path(local_prefix, "meta").read_bytes()
    if remote_metadata(prefix) == meta_bytes:
        return False
    meta = fmt.read_metadata(fmt.file_path(local_prefix, "meta"))
    for role in ("meta", "idx", "shards"):  # what makes the old dataset open goes first
        uri = file_uri(prefix, role)
        fs, path = filesystem(uri)
        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            retrying(uri, lambda fs=fs, path=path: fs.delete_file(path))
    if meta.get("layout") == "sharded" and not shards_uploaded:
        for number in shard_numbers(fmt.file_path(local_prefix, "shards"), meta):
            upload_dataset(fmt.shard_prefix(local_prefix, number), shard_location(prefix, number))
    for role in UPLOAD_ORDER:
        if fmt.file_path(local_prefix, role).exists():
            upload(fmt.file_path(local_prefix, role), file_uri(prefix, role))
    return True


def fetch_dataset(prefix: str, folder: str | os.PathLike, *, force: bool = False) -> Path:
    """Copy the remote dataset ``prefix`` into ``folder`` (named as it is there); the local prefix.

    Each file is written whole or not at all, the metadata and index last; verify the copy
    (:func:`mmidx.read.checks.verify`) before use. A copy of the same dataset already there is fetched again
    (repaired); another dataset there is replaced only with ``force``, and loses its index, metadata and report
    first."""
    meta, small = cached_small_files(prefix)  # checks the metadata (and the small files) first
    name = prefix.partition("?")[0].rstrip("/").rsplit("/", 1)[-1]
    local = Path(folder) / name
    if fmt.holds_dataset(local) and (read_json(fmt.file_path(local, "meta")) or {}).get("meta_sha256") != \
            meta["meta_sha256"]:
        if not force:
            raise StorageError(f"{local} holds another dataset than {redact(prefix)} (its metadata differs); pass "
                               f"{option('force', True)} to replace it, or fetch into another folder")
        for path in (fmt.report_path(local), fmt.file_path(local, "idx"), fmt.file_path(local, "meta")):
            path.unlink(missing_ok=True)  # it stops opening, and loses its report, before any file is replaced
    Path(folder).mkdir(parents=True, exist_ok=True)
    if meta.get("layout") == "sharded":  # its shards first, each a dataset, then its table and metadata
        for number in shard_numbers(small["shards"], meta):
            fetch_dataset(shard_location(prefix, number), Path(fmt.shard_prefix(local, number)).parent, force=force)
    for role in FETCH_ORDER:
        if role in meta["files"] or role == "meta":
            download(file_uri(prefix, role), fmt.file_path(local, role))
    return local


def hash_object(uri: str, algorithm: str) -> str:
    """Hex checksum (a key of ``format.FILE_HASHES``) of the object at ``uri``, streamed."""
    fs, path = filesystem(uri)

    def digest() -> str:
        state = fmt.FILE_HASHES[algorithm]()
        with fs.open_input_stream(path) as stream:
            while chunk := stream.read(8 << 20):
                state.update(chunk)
        return state.hexdigest()

    return retrying(uri, digest)
