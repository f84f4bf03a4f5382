"""``BlockCache``: a node's disk cache of remote data files, in fixed blocks, shared by its processes, within a limit.

A read of bytes [a, b) of a remote file is served block by block: a block this process keeps, checked, while
the cache still holds its entry, from memory (:mod:`mmidx.io.kept_blocks`: no system call); one found in the
cache is read whole and checked against its digest (a bad one is dropped and fetched again, never served), then
kept; the missing blocks are fetched, each run of neighbours in one ranged request, stored and kept (served
from what was fetched, not read back). Readers take no lock: an entry is written under a temporary name and
renamed into place, so a reader finds a whole entry or none. Storing and evicting take the folder's lock
(:class:`mmidx.io.cache_folder.Accounting`), which keeps the folder within its limit.

Eviction keeps what is needed soonest: a policy (:mod:`mmidx.read.next_use`, which knows the steps ahead from
the pack order) gives each block the step that reads it next, and when a block must make room, the blocks read
furthest ahead go first (Belady's policy), least recently used first among equals (so without a policy the
cache is LRU). A fetched block whose next use is further than everything cached is not stored (its read is
served anyway). Processes of one node evict by the same order: each computes it from the same schedule.

A folder the cache cannot write is a :class:`~mmidx.io.cache_folder.CacheError`; a write that fails mid-run (a
full disk) prints one line and the process goes on reading uncached.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import util
from typing import Any, NamedTuple, Protocol

import numpy as np
import xxhash

from mmidx.io import cache_folder as folder_
from mmidx.io.cache_folder import HEADER, MAGIC, CacheError, CacheSettings
from mmidx.io.kept_blocks import KeptBlocks, joined

NEVER = np.iinfo(np.int64).max  # the next use of a block no step ahead reads
KEPT_BYTES = 32 << 20  # checked blocks a process keeps in memory (BlockCache.at_hand), at most
HEADROOM = 32  # an eviction frees 1/HEADROOM of the limit beyond what it needs, so evictions come in batches
FLUSH_SECONDS = 1.0  # a process adds its counters to the state at least this often while it reads


class FileKey(NamedTuple):
    """A remote file as the cache knows it: the ``meta_sha256`` of the JSON describing it, its role there,
    the object's URI, the dataset it belongs to (as opened), and its size."""

    sha: str
    role: str
    uri: str
    dataset: str
    size: int


class EvictionPolicy(Protocol):
    """What the cache asks the schedule: the step at which each of ``blocks`` of file ``(sha, role)`` is read next
    (``NEVER``: not ahead), after ``pack`` (blocks just fetched for it) or, for ``pack`` None, from now on."""

    def next_use(self, key: tuple[str, str], blocks: np.ndarray, pack: int | None) -> np.ndarray: ...


def keep_nearest(next_use: np.ndarray, touched: np.ndarray, sizes: np.ndarray, room: int, headroom: int) -> np.ndarray:
    """Which entries to keep when ``sizes`` exceed ``room`` bytes: those read soonest (then the most recently
    touched), as many as fit in ``room - headroom``; all of them when they fit in ``room``."""
    keep = np.ones(len(sizes), dtype=bool)
    if int(sizes.sum()) <= room:
        return keep
    order = np.lexsort((-touched.astype(np.float64), next_use))
    keep[order] = np.cumsum(sizes[order]) <= room - headroom
    return keep


def read_into(fd: int, buffer: bytearray) -> int:
    """Read the file ``fd`` from its start into ``buffer`` until it is full or the file ends; the bytes read."""
    view, got = memoryview(buffer), 0
    while got < len(buffer) and (count := os.preadv(fd, [view[got:]], got)):
        got += count
    return got


def digest(key: FileKey, block: int, data: bytes | memoryview) -> bytes:
    """An entry's digest: xxh3-64 of its key and its bytes (an entry renamed to another block fails it too)."""
    state = xxhash.xxh3_64(f"{key.sha}/{key.role}/{block}".encode())
    state.update(data)
    return state.digest()


class _Role:
    """A role's arrays mapped in this process (``present`` changed under the lock, ``used`` a hint)."""

    def __init__(self, path: str, count: int):
        self.inode = os.stat(path + ".present").st_ino
        self.maps = []
        for suffix in ("present", "used"):
            with open(f"{path}.{suffix}", "r+b") as stream:
                if os.fstat(stream.fileno()).st_size != 8 * count:
                    raise OSError(f"{path}.{suffix}: not {count} blocks")
                self.maps.append(mmap.mmap(stream.fileno(), 8 * count))
        self.present, self.used = (np.frombuffer(mapped, dtype=np.uint64) for mapped in self.maps)


_opened: dict[tuple[int, CacheSettings], BlockCache] = {}  # by process (a forked worker opens its own)


class BlockCache:
    """The data cache of one folder, in this process (:meth:`of` makes one per process and settings)."""

    @classmethod
    def of(cls, settings: CacheSettings) -> BlockCache:
        key = (os.getpid(), settings)
        if key not in _opened:
            _opened[key] = cls(settings)
        return _opened[key]

    def __init__(self, settings: CacheSettings, block_size: int = folder_.BLOCK_SIZE):
        if settings.limit is None:
            raise CacheError(f"{settings.data}: a data cache needs a limit (cache_limit, MMIDX_CACHE_LIMIT)")
        self.settings, self.limit, self.data = settings, settings.limit, settings.data
        self.policy: EvictionPolicy | None = None
        self.counters = {name: 0 for name in folder_.new_run() if name != "started"}
        self.writable = True
        self._roles: dict[tuple[str, str], _Role] = {}
        self._names = itertools.count()
        self._flushed, self._pid = time.monotonic(), os.getpid()
        self._lock = threading.Lock()  # stores and evictions, and the maps, across this process's threads
        self._counting = threading.Lock()  # the counters (the others, set under _lock, are not a read's)
        self.kept = KeptBlocks(KEPT_BYTES)
        self.block_size = folder_.checked(settings, block_size)
        self.accounting = folder_.Accounting(self.data, self.block_size)
        self._users = os.open(self.data / "users", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            starting = True  # no other process has the cache open: a new run
        except BlockingIOError:
            starting = False
        fcntl.flock(self._users, fcntl.LOCK_SH)
        with self.accounting.hold() as state:
            if starting:
                state["run"] = folder_.new_run()
            state["limit"] = self.limit
            if state["bytes"] > self.limit:  # a smaller limit than the last run's
                self._make_room(state, None, np.zeros(0, np.int64), None)
        util.Finalize(self, self.flush, exitpriority=10)  # at exit, worker processes included

    # -- reading --------------------------------------------------------------------------------------------

    def read(self, key: FileKey, start: int, stop: int, fetch: Callable[[int, int], bytes],
             pack: int | None = None) -> memoryview:
        """Bytes [start, stop) of the file ``key``: its blocks from the cache, the missing ones from ``fetch(a, b)``
        (one call per run of neighbours), stored for later reads; ``pack``: the pack they are fetched for."""
        size, stop = self.block_size, min(stop, key.size)
        blocks = range(start // size, (stop - 1) // size + 1)
        found = self._at_hand(key, blocks)
        for index, block in enumerate(blocks):
            if found[index] is None:
                found[index] = self._load(key, block)
        missing = [block for block, data in zip(blocks, found, strict=True) if data is None]
        fetched = 0
        for _, run in itertools.groupby(enumerate(missing), lambda pair: pair[1] - pair[0]):
            run_blocks = [block for _, block in run]
            first = run_blocks[0] * size
            data = memoryview(fetch(first, min((run_blocks[-1] + 1) * size, key.size)))
            fetched += len(data)
            new = {block: data[block * size - first:(block + 1) * size - first] for block in run_blocks}
            for block, part in new.items():  # served from what was fetched, not read back
                found[block - blocks.start] = part
            self._store(key, new, pack)
        self._count(hits=len(blocks) - len(missing), misses=len(missing), bytes_fetched=fetched,
                    bytes_from_cache=sum(map(len, found)) - fetched)
        return joined(found, start - blocks.start * size, stop - start)

    def at_hand(self, key: FileKey, start: int, stop: int) -> memoryview | None:
        """Bytes [start, stop) of the file ``key`` if this process keeps every block they lie in, checked, and
        each is still in the cache (no system call, no request); else None."""
        size, stop = self.block_size, min(stop, key.size)
        blocks = range(start // size, (stop - 1) // size + 1)
        found = self._at_hand(key, blocks)
        if any(data is None for data in found):
            return None
        self._count(hits=len(blocks), bytes_from_cache=sum(map(len, found)))
        return joined(found, start - blocks.start * size, stop - start)

    def _path(self, key: FileKey, block: int) -> str:
        return f"{self.data}/{key.sha}/{key.role}/{block}"

    def _at_hand(self, key: FileKey, blocks: range) -> list[memoryview | None]:
        """The kept bytes of each of ``blocks`` whose entry is still the one checked (None for the others); the
        blocks' read times (the hint) set."""
        role = self._roles.get(key[:2])
        if role is None:
            return [None] * len(blocks)
        role.used[blocks.start:blocks.stop] = time.time_ns()
        return self.kept.get(key.sha, key.role, blocks, role.present)

    def _load(self, key: FileKey, block: int) -> memoryview | None:
        """The block's bytes if a good entry holds them (no lock), kept; a bad entry is dropped."""
        role = self._mapped_role(key)
        stamp = int(role.present[block]) if role is not None else 0  # before the entry is read: never newer
        expected = min(self.block_size, key.size - block * self.block_size)
        raw = bytearray(HEADER + expected + 1)  # a byte more: a longer file shows
        try:
            fd = os.open(self._path(key, block), os.O_RDONLY)
        except OSError:
            return None
        try:
            inode, got = os.fstat(fd).st_ino, read_into(fd, raw)
        except OSError:
            return None
        finally:
            os.close(fd)
        data = memoryview(raw).toreadonly()[HEADER:HEADER + expected]  # kept: no reader may change it
        if got != HEADER + expected or raw[:len(MAGIC)] != MAGIC or raw[len(MAGIC):HEADER] != digest(key, block, data):
            self._drop(key, block, inode)
            return None
        self.kept.put(key.sha, key.role, [(block, data, stamp)])
        return data

    def _mapped_role(self, key: FileKey) -> _Role | None:
        """The role's arrays mapped in this process (once; no lock needed to read a complete role's), or None
        when the cache has no complete role for ``key``."""
        role = self._roles.get(key[:2])
        if role is None:
            path = f"{self.data}/{key.sha}/{key.role}"
            try:
                if not os.path.exists(path + ".json"):
                    return None
                role = self._roles[key[:2]] = _Role(path, folder_.block_count(key.size, self.block_size))
            except OSError:
                return None
        return role

    # -- storing and evicting (under the lock) ---------------------------------------------------------------

    def _store(self, key: FileKey, blocks: dict[int, memoryview], pack: int | None) -> None:
        if not self.writable:
            return
        stored: list[tuple[int, memoryview, int]] = []
        try:
            with self._lock, self.accounting.hold() as state:  # a failure leaves it busy: the next holder repairs
                self._flush(state)
                role = self._role(state, key)
                if role is None:  # the limit cannot hold the file's arrays
                    self.counters["bypassed"] += len(blocks)
                    return
                new = np.array([block for block in blocks if not role.present[block]], dtype=np.int64)
                sizes = folder_.entry_bytes(key.size, self.block_size, new)
                if state["bytes"] + int(sizes.sum()) > self.limit:
                    kept = self._make_room(state, key, new, pack)
                    self.counters["bypassed"] += len(kept) - int(kept.sum())
                    new, sizes = new[kept], sizes[kept]
                for block, accounted in zip(new.tolist(), sizes.tolist(), strict=True):
                    self._write(key, block, blocks[block])
                    state["bytes"] += accounted
                    role.present[block] = stamp = time.time_ns()
                    stored.append((block, blocks[block], stamp))
        except OSError as error:  # a full disk, a folder made read-only: go on uncached
            self.writable = False
            print(f"mmidx: cache {self.data}: cannot store a block ({error.strerror or error}); this process reads "
                  "uncached from now on (free space or give another --cache-dir)", file=sys.stderr)
        self.kept.put(key.sha, key.role, stored)

    def _write(self, key: FileKey, block: int, data: memoryview) -> None:
        """Write one entry: under a temporary name, then renamed (no reader ever finds part of one)."""
        temporary = self.data / "tmp" / f"{os.getpid()}.{next(self._names)}"
        try:
            with open(temporary, "wb") as stream:
                stream.write(MAGIC + digest(key, block, data))
                stream.write(data)
            os.replace(temporary, self._path(key, block))
        finally:
            temporary.unlink(missing_ok=True)

    def _role(self, state: dict[str, Any], key: FileKey) -> _Role | None:
        """The role's arrays, mapped in this process; its files created first (counted, room made for them) if
        the cache lacks them; None when the limit cannot hold them."""
        path = f"{self.data}/{key.sha}/{key.role}"
        mapped = self._roles.get(key[:2])
        try:
            if mapped is not None and os.stat(path + ".present").st_ino == mapped.inode and os.path.isdir(path):
                return mapped
        except FileNotFoundError:
            pass
        count = folder_.block_count(key.size, self.block_size)
        if not os.path.exists(path + ".json"):
            described = json.dumps({"dataset": key.dataset, "uri": key.uri, "bytes": key.size})
            extra = folder_.accounted(len(described.encode())) + folder_.PAGE + 2 * folder_.accounted(8 * count) + \
                (0 if os.path.isdir(os.path.dirname(path)) else folder_.PAGE)
            state["bytes"] += extra
            if state["bytes"] > self.limit:
                self._make_room(state, None, np.zeros(0, np.int64), None)
            if state["bytes"] > self.limit:
                state["bytes"] -= extra
                return None
            os.makedirs(path, exist_ok=True)
            for suffix in ("present", "used"):  # new files, renamed: a process mapping an old one keeps it whole
                fresh = self.data / "tmp" / f"{os.getpid()}.{next(self._names)}"
                try:
                    with open(fresh, "wb") as stream:
                        stream.truncate(8 * count)
                    os.replace(fresh, f"{path}.{suffix}")
                finally:
                    fresh.unlink(missing_ok=True)
            with open(path + ".json", "w") as stream:  # last: the role is complete
                stream.write(described)
        self._roles[key[:2]] = _Role(path, count)
        return self._roles[key[:2]]

    def _make_room(self, state: dict[str, Any], key: FileKey | None, new: np.ndarray, pack: int | None) -> np.ndarray:
        """Evict the entries read furthest ahead until the ``new`` blocks of ``key`` that are read sooner fit, with
        headroom; which of ``new`` to store."""
        stored: list[tuple[_Role, np.ndarray, FileKey]] = []
        next_use, touched, sizes = [np.zeros(0, np.int64)], [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
        for sha, name, meta in folder_.roles(self.data):
            probe = FileKey(sha, name, str(meta.get("uri")), meta["dataset"], meta["bytes"])
            try:
                role = self._role(state, probe)
            except OSError:  # arrays of the wrong size: the next repair rebuilds them
                continue
            if role is None:
                continue
            blocks = np.flatnonzero(role.present)
            stored.append((role, blocks, probe))
            next_use.append(self._next_use((sha, name), blocks, None))
            touched.append(np.maximum(role.present[blocks], role.used[blocks]))
            sizes.append(folder_.entry_bytes(meta["bytes"], self.block_size, blocks))
        entries = int(sum(int(s.sum()) for s in sizes))
        if key is not None:
            next_use.append(self._next_use(key[:2], new, pack))
            touched.append(np.full(len(new), time.time_ns(), dtype=np.uint64))
            sizes.append(folder_.entry_bytes(key.size, self.block_size, new))
        room = self.limit - (state["bytes"] - entries)
        keep = keep_nearest(np.concatenate(next_use), np.concatenate(touched), np.concatenate(sizes), room,
                            self.limit // HEADROOM)
        position = 0
        for role, blocks, probe in stored:
            for block in blocks[~keep[position:position + len(blocks)]].tolist():
                role.present[block] = 0
                try:
                    os.unlink(self._path(probe, block))
                except FileNotFoundError:
                    pass
                state["bytes"] -= int(folder_.entry_bytes(probe.size, self.block_size, [block])[0])
                self.counters["evicted"] += 1
            position += len(blocks)
        return keep[position:]

    def _next_use(self, key: tuple[str, str], blocks: np.ndarray, pack: int | None) -> np.ndarray:
        if self.policy is None or len(blocks) == 0:
            return np.full(len(blocks), NEVER, dtype=np.int64)
        return np.asarray(self.policy.next_use(key, blocks, pack), dtype=np.int64)

    def _drop(self, key: FileKey, block: int, inode: int) -> None:
        """Remove a bad entry, if the path still holds that file (another process may have replaced it)."""
        with self._lock, self.accounting.hold() as state:
            self.counters["dropped"] += 1
            try:
                if os.stat(self._path(key, block)).st_ino != inode:
                    return
                os.unlink(self._path(key, block))
            except FileNotFoundError:
                return
            role = self._role(state, key) if os.path.exists(f"{self.data}/{key.sha}/{key.role}.json") else None
            if role is not None and role.present[block]:
                role.present[block] = 0
                state["bytes"] -= int(folder_.entry_bytes(key.size, self.block_size, [block])[0])

    # -- counters -------------------------------------------------------------------------------------------

    def _count(self, **amounts: int) -> None:
        """Add a read's counts (hits, misses, bytes): under their own lock, so that a read never waits for a store
        of this process's (which holds ``_lock`` while it writes, and the folder's lock)."""
        with self._counting:
            for name, amount in amounts.items():
                self.counters[name] += amount
        if time.monotonic() - self._flushed > FLUSH_SECONDS:
            self.flush(wait=False)

    def flush(self, wait: bool = True) -> None:
        """Add this process's counters to the run's, in the state; with ``wait=False`` only when no store of this
        process holds the lock now (a store under way adds them itself)."""
        if os.getpid() != self._pid or not any(self.counters.values()) or not self._lock.acquire(blocking=wait):
            return
        try:
            with self.accounting.hold() as state:
                self._flush(state)
        finally:
            self._lock.release()

    def _flush(self, state: dict[str, Any]) -> None:
        with self._counting:
            for name, amount in self.counters.items():
                state["run"][name] = state["run"].get(name, 0) + amount
                self.counters[name] = 0
            self._flushed = time.monotonic()
