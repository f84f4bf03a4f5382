"""``RemoteFile``: the byte source that stands for a dataset's ``.bin`` or ``.images`` in object storage.

``source[a:b]`` is exactly bytes [a, b) of the object, or a :class:`~mmidx.io.storage.StorageError`: served from
chunks fetched ahead of need (:mod:`mmidx.read.prefetch`, on a per-process thread pool) or, failing that, from
one ranged request retried as :func:`~mmidx.io.storage.retrying` does. With a data cache (a limit in its
:class:`~mmidx.io.cache_folder.CacheSettings`), both go through the node's disk cache
(:class:`~mmidx.io.block_cache.BlockCache`): blocks found there are not requested again. Offline (its settings'
``offline``), a remote dataset opens only when the cache holds every block of its data files, and a block missing
later (evicted meanwhile) is an error naming it: the store is never asked.
"""

from __future__ import annotations

import bisect
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mmidx.errors import option
from mmidx.io.block_cache import BlockCache, FileKey
from mmidx.io.cache_folder import CacheSettings, checked
from mmidx.io.small_files import cached_small_files
from mmidx.io.storage import StorageError, file_uri, filesystem, object_size, redact, retrying

FETCH_THREADS = 8  # ranged requests in flight per process


_pools: dict[int, ThreadPoolExecutor] = {}
Chunk = tuple[int, int, "Future | memoryview"]  # bytes [start, stop) of the file: being fetched, or at hand


def fetch_pool() -> ThreadPoolExecutor:
    """This process's pool of ranged requests (a forked worker makes its own)."""
    pid = os.getpid()
    if pid not in _pools:
        _pools[pid] = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="mmidx-fetch")
    return _pools[pid]


class RemoteFile:
    """A dataset file in object storage read by byte range: ``len()`` is its size, ``source[a:b]`` the
    bytes [a, b) as a memoryview, exactly that many or a :class:`StorageError`.

    Chunks fetched ahead (:meth:`fetch`, tagged by pack) serve the reads they cover until they are
    :meth:`release`-d; other reads are one ranged request each. ``requests`` counts requests made,
    ``misses`` the reads no fetched chunk served. ``key`` names the file in the cache, which ``settings`` with
    a limit turns on.
    """

    def __init__(self, uri: str, size: int, key: FileKey | None = None, settings: CacheSettings | None = None):
        self.uri, self.size, self.key, self.settings = uri, size, key, settings
        self.requests = self.misses = 0
        self._handle: Any = None  # opened at the first request (a worker served by the cache makes none)
        self._lock = threading.Lock()
        self._chunks: dict[Any, tuple[list[int], list[Chunk]]] = {}  # by tag: the starts, and the chunks, sorted
        self._cache: tuple[int, BlockCache | None] | None = None

    def __len__(self) -> int:
        return self.size

    def __reduce__(self) -> tuple[Any, ...]:
        return RemoteFile, (self.uri, self.size, self.key, self.settings)

    @property
    def cache(self) -> BlockCache | None:
        """This process's data cache for the file (None: read uncached)."""
        if self._cache is None or self._cache[0] != os.getpid():
            on = self.key is not None and self.settings is not None and self.settings.limit is not None
            self._cache = os.getpid(), BlockCache.of(self.settings) if on else None
        return self._cache[1]

    def _read(self, start: int, stop: int, pack: Any = None) -> bytes | memoryview:
        """Bytes [start, stop): through the cache when there is one (``pack``: what they are fetched for)."""
        cache, fetch = self.cache, self._missing if self.settings is not None and self.settings.offline else self._get
        if cache is None:
            return fetch(start, stop)
        return cache.read(self.key, start, stop, fetch, pack if isinstance(pack, int) else None)

    def _missing(self, start: int, stop: int) -> bytes:
        """Offline, what a fetch is: an error naming the first block missing from the cache."""
        cache = self.cache
        block = start // cache.block_size if cache is not None else 0
        raise StorageError(missing_block(self.uri, block, self.settings))

    def _get(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) from storage: one ranged request, retried."""
        def read() -> bytes:
            if self._handle is None:
                system, path = filesystem(self.uri)
                self._handle = system.open_input_file(path)
            return self._handle.read_at(stop - start, start)

        with self._lock:
            self.requests += 1
        data = retrying(self.uri, read)
        if len(data) != stop - start:
            raise StorageError(f"{self.uri}: object shorter than the metadata says (bytes [{start}, {stop}) "
                               f"asked, {len(data)} came): re-upload the dataset")
        return data

    def __getitem__(self, key: slice) -> memoryview:
        start, stop, step = key.indices(self.size)
        if step != 1 or key.start is None or key.stop is None or stop < start:
            raise IndexError(f"{self.uri}: read by slices [a:b] inside [0, {self.size}], not {key}")
        if start == stop:
            return memoryview(b"")
        with self._lock:
            chunk = self._chunk(start, stop)
        if chunk is None:
            self.misses += 1
            return memoryview(self._read(start, stop))
        data = chunk[2].result() if isinstance(chunk[2], Future) else chunk[2]
        return memoryview(data)[start - chunk[0]:stop - chunk[0]]

    def _chunk(self, start: int, stop: int) -> Chunk | None:
        """A chunk holding [start, stop), if one was fetched (under the lock)."""
        for starts, chunks in self._chunks.values():
            at = bisect.bisect_right(starts, start) - 1
            if at >= 0 and stop <= chunks[at][1]:
                return chunks[at]
        return None

    def fetch(self, tag: Any, ranges: list[tuple[int, int]]) -> int:
        """Start fetching ``ranges`` (inside the file, not overlapping) for ``tag``; the bytes asked. Ranges whose
        blocks this process keeps from the data cache are served at once (:meth:`BlockCache.at_hand`)."""
        cache = self.cache
        fetched: list[Chunk] = []
        for start, stop in ranges:
            data = None if cache is None else cache.at_hand(self.key, start, stop)
            if data is None:
                data = fetch_pool().submit(self._read, start, stop, tag)
            fetched.append((start, stop, data))
        with self._lock:
            chunks = sorted(self._chunks.get(tag, ([], []))[1] + fetched, key=lambda chunk: chunk[0])
            self._chunks[tag] = [chunk[0] for chunk in chunks], chunks
        return sum(stop - start for start, stop in ranges)

    def release(self, tag: Any) -> None:
        """Drop the chunks fetched for ``tag`` (a failed fetch is raised by the read that needs it)."""
        with self._lock:
            self._chunks.pop(tag, None)

    def fetched(self, tag: Any) -> bool:
        """Whether chunks were fetched for ``tag`` and not released."""
        with self._lock:
            return tag in self._chunks


def data_file(prefix: str, role: str, meta: dict[str, Any], settings: CacheSettings | None = None, *,
              checked: bool = True) -> RemoteFile:
    """The data file ``role`` ("bin", "images") of the remote dataset ``prefix``, checked to hold
    exactly the bytes its metadata records (``checked=False``: a process that opened it already checked)."""
    uri, expected = file_uri(prefix, role), meta["files"][role]["bytes"]
    key = FileKey(meta["meta_sha256"], role, uri, prefix, expected)
    if not checked:
        return RemoteFile(uri, expected, key, settings)
    size = object_size(uri)
    if size < expected:
        raise StorageError(f"{uri}: object shorter than the metadata says ({size} bytes, {expected} recorded): "
                           "the upload did not finish; re-upload the dataset")
    if size > expected:
        raise StorageError(f"{uri}: {size} bytes, the metadata records {expected}: the object was replaced; "
                           "re-upload the dataset")
    return RemoteFile(uri, size, key, settings)


def remote_dataset(prefix: str, settings: CacheSettings,
                   known: str | None = None) -> tuple[dict[str, Any], dict[str, Path], dict[str, RemoteFile]]:
    """The remote dataset ``prefix``: its metadata, the local copies of its small files (in ``settings.folder``)
    and its data files as byte sources (through the data cache when ``settings`` has a limit). ``known``: the
    ``meta_sha256`` the process that pickled it opened (a loader worker reads that version, or none). Offline
    (``settings.offline``), from the cache alone: its small files, and every block of its data files."""
    if settings.offline and settings.limit is None:
        raise StorageError(f"{redact(prefix)}: {option('cache_offline', True)} reads the data from the node's data "
                           f"cache: give {option('cache_limit')} too (the limit the cache was filled with)")
    if settings.limit is not None:  # a data cache it cannot use is one line now, not a failure in a worker
        checked(settings)
    meta, local = cached_small_files(prefix, settings.folder, known, offline=settings.offline)
    if known is not None and meta["meta_sha256"] != known:
        raise StorageError(f"{prefix}: replaced in storage since this job opened it (metadata {known[:12]}..., now "
                           f"{meta['meta_sha256'][:12]}...): restart the job to read the new version")
    files = {role: data_file(prefix, role, meta, settings, checked=known is None and not settings.offline)
             for role in ("bin", "images") if role in meta["files"]}
    for file in files.values() if settings.offline else ():
        require_cached(file)
    return meta, local, files


def require_cached(file: RemoteFile) -> None:
    """Offline: a :class:`StorageError` naming the first block of ``file`` the node's cache does not hold."""
    cache = file.cache
    block = 0 if cache is None or file.key is None else cache.first_missing(file.key)
    if block is not None:
        raise StorageError(missing_block(file.uri, block, file.settings))


def missing_block(uri: str, block: int, settings: CacheSettings | None) -> str:
    """The error of an offline read of ``uri`` whose block ``block`` the node's cache does not hold."""
    folder = settings.data if settings is not None else "the data cache"
    return (f"{redact(uri)}: block {block} is not in this node's cache {folder}, and {option('cache_offline', True)} "
            f"never asks the store: open the dataset once with the store reachable to fill the cache (a limit that "
            "holds the dataset), or without it")
