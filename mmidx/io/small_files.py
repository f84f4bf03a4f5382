"""The small files of remote datasets (``.meta.json``, ``.idx``, ``.plan``, a shard table) cached on the node, and
whole copies.

Opening a remote dataset downloads its metadata, checked against its own checksum, and finds the ``.idx`` and
``.plan`` it lists in ``DIR/remote/META_SHA256/`` (:func:`mmidx.io.storage.cache_root`), downloading those that
are missing. Every open checks each cached copy's size and checksum against the metadata, not only the download:
a copy changed on the node's disk (a flipped bit, an edit) would otherwise change what every reader of the node
trains on, with every later check passing. A copy that fails is said in one line and downloaded again (checked),
never read. They are small (an index and a plan: megabytes), and the pages hashed are the pages then mapped.

``offline`` (``cache_offline``, ``MMIDX_CACHE_OFFLINE=1``) opens the dataset from the cached files alone, the store
never asked: the version a worker's parent opened, else the one last opened with the store reachable; each file
checked as above, and a missing or damaged one is one error naming it (there is nothing to download it from).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

from mmidx import format as fmt
from mmidx.errors import option
from mmidx.format import FormatError
from mmidx.io.cache_admin import same_dataset
from mmidx.io.files import read_json
from mmidx.io.storage import StorageError, cache_root, download, file_uri, redact, shard_location, shard_numbers

FETCH_ORDER = ("bin", "images", "plan", "shards", "meta", "idx")  # locally a text .idx/.bin pair opens without meta


def small_file_copy(folder: Path, role: str) -> Path:
    """Where the cache folder ``folder`` of one dataset version (``DIR/remote/META_SHA256``) keeps the file ``role``."""
    return folder / f"dataset{fmt.SUFFIXES[role]}"


def cached_small_files(prefix: str, cache_dir: str | os.PathLike | None = None, known: str | None = None, *,
                       offline: bool = False,
                       damaged: list[str] | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Metadata of the remote dataset ``prefix`` and the local copies of its small files, each checked against the
    checksum the metadata records (downloaded once into :func:`~mmidx.io.storage.cache_root`, checked again at every
    open). ``known``: the ``meta_sha256`` another process of this job opened (a loader worker): its cached files are
    used without asking storage again. ``offline``: storage is never asked. ``damaged``: where to list the copies
    found damaged (and downloaded again) instead of saying so on stderr."""
    root, meta = cache_root(cache_dir), None
    if known is not None or offline:
        folder = root / known if known is not None else last_opened(prefix, root, f"dataset{fmt.SUFFIXES['meta']}")
        copy = small_file_copy(folder, "meta")
        try:
            meta = fmt.read_metadata(copy)  # checks its own checksum
            if known is not None and meta["meta_sha256"] != known:
                raise FormatError(f"{copy}: the metadata of another version than {known[:12]}...")
        except FormatError as error:
            if offline:
                raise StorageError(f"{redact(prefix)}: cannot be opened offline: {error} (open it once with the store "
                                   f"reachable, or without {option('cache_offline', True)})") from None
            if copy.exists():
                _say(f"{error}: this node's cached copy of {redact(file_uri(prefix, 'meta'))}", damaged)
            meta = None
    if meta is None:
        meta, folder = _fetched_metadata(prefix, root)
    if not (folder / "uri").exists():  # which dataset it is, for `mmidx cache clear --dataset` and offline opens
        (folder / "uri").write_text(prefix)
    paths = {"meta": small_file_copy(folder, "meta")}
    for role in ("idx", "plan", "shards"):
        if role in meta["files"]:
            paths[role] = small_file_copy(folder, role)
            checked_copy(file_uri(prefix, role), meta["files"][role], paths[role], offline, damaged)
    return meta, paths


def checked_copy(uri: str, entry: dict[str, Any], local: Path, offline: bool = False, damaged: list[str] | None = None,
                 remedy: str = "re-upload the dataset") -> None:
    """Make ``local`` a copy of the object ``uri`` that matches ``entry`` (its size and checksum in the metadata): the
    cached one if it does, else a fresh download, checked before it is renamed into place (``offline``: an error).
    ``damaged``: where to list a cached copy found damaged, instead of stderr; ``remedy``: what to do when the object
    itself differs."""
    algorithm = next((name for name in fmt.FILE_HASHES if name in entry), fmt.FILE_HASH)
    if local.exists():
        if local.stat().st_size == entry["bytes"] and fmt.hash_file(local, algorithm) == entry.get(algorithm):
            return
        problem = f"{local}: this node's cached copy of {redact(uri)} differs from its {algorithm} checksum or size " \
                  "(changed on this disk)"
        if offline:
            raise StorageError(f"{problem}: cannot be opened offline (open it with the store reachable, which fetches "
                               f"it again, or without {option('cache_offline', True)})")
        _say(problem, damaged)
    elif offline:
        raise StorageError(f"{local}: missing: {redact(uri)} cannot be opened offline (open it once with the store "
                           f"reachable, or without {option('cache_offline', True)})")
    unverified = local.with_name(f"{local.name}.{os.getpid()}.{threading.get_ident()}.unverified")
    try:
        download(uri, unverified)
        if unverified.stat().st_size != entry["bytes"] or fmt.hash_file(unverified, algorithm) != entry.get(algorithm):
            raise StorageError(f"{uri}: its {algorithm} checksum or size differs from the metadata: the object was "
                               f"replaced or corrupted; {remedy}")
        os.replace(unverified, local)
    finally:
        unverified.unlink(missing_ok=True)


def _say(problem: str, damaged: list[str] | None) -> None:
    """Report a damaged cached copy, which is then downloaded again: in ``damaged``, else on stderr."""
    if damaged is None:
        print(f"mmidx: {problem}: fetched again", file=sys.stderr)
    else:
        damaged.append(problem)


def last_opened(uri: str, root: Path, copy: str) -> Path:
    """The folder in the cache ``root`` of the version of ``uri`` (a dataset, or an encoding's JSON) last opened with
    the store reachable: of those whose ``uri`` file names it, the one whose metadata ``copy`` was downloaded last."""
    found = []
    for folder in root.glob("*"):
        try:
            if same_dataset((folder / "uri").read_text(), uri):
                found.append((os.stat(folder / copy).st_mtime_ns, folder))
        except OSError:
            continue
    if not found:
        raise StorageError(f"{redact(uri)}: not in this node's cache {root}: cannot be opened offline (open it once "
                           f"with the store reachable, or without {option('cache_offline', True)})")
    return max(found)[1]


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
        os.replace(fresh, small_file_copy(folder, "meta"))
    finally:
        fresh.unlink(missing_ok=True)
    return meta, folder


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
