"""``BlockCache``: a node's disk cache of remote data files, in fixed blocks, shared by its processes, within a limit.

A read of bytes [a, b) of a remote file is served block by block: a block this process keeps, checked, while
the cache still holds its entry, from memory (:mod:`mmidx.io.kept_blocks`: no system call); one found in the
cache is read whole and checked against its digest (a bad one is dropped and fetched again, never served), then
kept; the missing blocks are fetched, each run of neighbours in one ranged request, stored and kept (served
from what was fetched, not read back). Readers take no lock: an entry is written under a temporary name and
renamed into place, so a reader finds a whole entry or none. A block another thread of the process is fetching
is waited for, not fetched again (:class:`~mmidx.io.kept_blocks.Fetching`). Storing and evicting
(:mod:`mmidx.io.block_store`: by next use) take the folder's lock
(:class:`~mmidx.io.cache_accounting.Accounting`), which keeps the folder within its limit.

A folder the cache cannot write is a :class:`~mmidx.io.cache_folder.CacheError`. A write that fails mid-run (a
full disk), or the folder's lock not had within its wait (a holder stopped), prints one line naming the cause,
and the process stores nothing more and takes no lock: it reads the blocks cached and fetches the rest; it says
so again when it ends.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import util
from typing import Any

import numpy as np

from mmidx.io import cache_folder as folder_
from mmidx.io.block_store import BlockStore, EvictionPolicy, FileKey, digest
from mmidx.io.cache_accounting import Accounting, least_bytes, lock_file
from mmidx.io.cache_folder import HEADER, MAGIC, CacheError, CacheSettings
from mmidx.io.kept_blocks import Fetching, KeptBlocks, joined
from mmidx.io.lock import LockTimeout, wait_for_flock
from mmidx.io.role_arrays import RoleArrays

KEPT_BYTES = 32 << 20  # checked blocks a process keeps in memory (BlockCache.at_hand), at most
FLUSH_SECONDS = 1.0  # a process adds its counters to the state at least this often while it reads


def read_into(fd: int, buffer: bytearray) -> int:
    """Read the file ``fd`` from its start into ``buffer`` until it is full or the file ends; the bytes read."""
    view, got = memoryview(buffer), 0
    while got < len(buffer) and (count := os.preadv(fd, [view[got:]], got)):
        got += count
    return got


_opened: dict[tuple[int, os.PathLike, int], BlockCache] = {}  # by process (a forked worker opens its own) and folder


class BlockCache(BlockStore):
    """The data cache of one folder, in this process (:meth:`of` makes one per process, folder and limit)."""

    @classmethod
    def of(cls, settings: CacheSettings) -> BlockCache:
        key = (os.getpid(), settings.folder, settings.limit)
        if key not in _opened:
            _opened[key] = cls(settings)
        return _opened[key]

    def __init__(self, settings: CacheSettings, block_size: int = folder_.BLOCK_SIZE):
        if settings.limit is None:
            raise CacheError(f"{settings.data}: a data cache needs a limit (cache_limit, MMIDX_CACHE_LIMIT)")
        self.settings, self.limit, self.data = settings, settings.limit, settings.data
        self.policy: EvictionPolicy | None = None
        self.counters = {name: 0 for name in folder_.new_run() if name != "started"}
        self.off: str | None = None  # since when and why this process stopped storing (then it takes no lock)
        self._roles: dict[tuple[str, str], RoleArrays] = {}
        self._names, self._repairs = itertools.count(), 0
        self._flushed, self._pid = time.monotonic(), os.getpid()
        self._lock = threading.Lock()  # stores and evictions, and the arrays, across this process's threads
        self._counting = threading.Lock()  # the counters (the others, set under _lock, are not a read's)
        self.kept, self.fetching = KeptBlocks(KEPT_BYTES), Fetching()
        self.block_size = folder_.checked(settings, block_size)
        util.Finalize(self, self._at_exit, exitpriority=10)  # at exit, worker processes included
        try:
            self.accounting = Accounting(self.data, self.block_size)
            self._users = lock_file(self.data / "users")
            try:
                fcntl.flock(self._users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                starting = True  # no other process has the cache open: a new run
            except BlockingIOError:
                starting = False
            wait_for_flock(self._users, fcntl.LOCK_SH, self.data / "users", self.accounting.wait)
            with self.accounting.hold() as state:
                if starting:
                    state["run"] = folder_.new_run()
                    if state["bytes"] < least_bytes(self.data, self.block_size):  # counted short: recounted
                        self._repair(state)
                state["limit"] = self.limit
                if state["bytes"] > self.limit:  # a smaller limit than the last run's
                    self._make_room(state, None, np.zeros(0, np.int64), None)
        except LockTimeout as error:
            self._turn_off(f"{error}", "resume or end that process")
        except OSError as error:
            raise CacheError(f"{self.data}: the data cache cannot be opened ({error.strerror or error}): give a "
                             "writable --cache-dir (MMIDX_CACHE_DIR), or no --cache-limit to read uncached") from None

    # -- reading --------------------------------------------------------------------------------------------

    def read(self, key: FileKey, start: int, stop: int, fetch: Callable[[int, int], bytes],
             pack: int | None = None) -> memoryview:
        """Bytes [start, stop) of the file ``key``: its blocks from the cache, the missing ones from ``fetch(a, b)``
        (one call per run of neighbours), stored for later reads; ``pack``: the pack they are fetched for. A block
        another thread of this process is fetching is waited for, not fetched again."""
        size, stop = self.block_size, min(stop, key.size)
        blocks = range(start // size, (stop - 1) // size + 1)
        found = self._at_hand(key, blocks)
        for index, block in enumerate(blocks):
            if found[index] is None:
                found[index] = self._load(key, block)
        missing = [block for block, data in zip(blocks, found, strict=True) if data is None]
        mine, theirs = self.fetching.claim(key.sha, key.role, missing)
        try:
            fetched = self._fetch(key, mine, fetch, pack, found, blocks.start)
        finally:
            self.fetching.release(key.sha, key.role, {block: found[block - blocks.start] for block in mine})
        shared, again = 0, []
        for block, flight in theirs:
            found[block - blocks.start] = part = flight.result()
            if part is None:  # that fetch failed: this read asks again
                again.append(block)
            else:
                shared += len(part)
        fetched += self._fetch(key, again, fetch, pack, found, blocks.start)
        self._count(hits=len(blocks) - len(missing), misses=len(missing), bytes_fetched=fetched,
                    bytes_from_cache=sum(map(len, found)) - fetched - shared)
        return joined(found, start - blocks.start * size, stop - start)

    def _fetch(self, key: FileKey, missing: list[int], fetch: Callable[[int, int], bytes], pack: int | None,
               found: list[memoryview | None], first_block: int) -> int:
        """Fetch ``missing`` blocks into ``found`` (indexed from ``first_block``), one request per run of
        neighbours, and store them; the bytes fetched."""
        size, fetched = self.block_size, 0
        for _, run in itertools.groupby(enumerate(missing), lambda pair: pair[1] - pair[0]):
            run_blocks = [block for _, block in run]
            first = run_blocks[0] * size
            data = memoryview(fetch(first, min((run_blocks[-1] + 1) * size, key.size)))
            fetched += len(data)
            new = {block: data[block * size - first:(block + 1) * size - first] for block in run_blocks}
            for block, part in new.items():  # served from what was fetched, not read back
                found[block - first_block] = part
            self._store(key, new, pack)
        return fetched

    def at_hand(self, key: FileKey, start: int, stop: int) -> memoryview | None:
        """Bytes [start, stop) of the file ``key`` if this process keeps every block they lie in, checked, and
        each is still in the cache (no request), else None."""
        size, stop = self.block_size, min(stop, key.size)
        blocks = range(start // size, (stop - 1) // size + 1)
        found = self._at_hand(key, blocks)
        if any(data is None for data in found):
            return None
        self._count(hits=len(blocks), bytes_from_cache=sum(map(len, found)))
        return joined(found, start - blocks.start * size, stop - start)

    def first_missing(self, key: FileKey) -> int | None:
        """The first block of the file ``key`` the cache does not hold (None: it holds every one)."""
        role = self._mapped_role(key)
        if role is None:
            return 0
        absent = np.flatnonzero(role.present() == 0)
        return int(absent[0]) if len(absent) else None

    def _at_hand(self, key: FileKey, blocks: range) -> list[memoryview | None]:
        """The kept bytes of each of ``blocks`` whose entry is still the one checked (None for the others); the
        blocks' read times (the hint) set."""
        role = self._roles.get(key[:2])
        if role is None:
            return [None] * len(blocks)
        try:
            role.touch(blocks.start, blocks.stop, time.time_ns())
            stamps = role.stamps(blocks.start, blocks.stop)
        except OSError:  # its files closed by another thread replacing the role: read from the cache again
            return [None] * len(blocks)
        return self.kept.get(key.sha, key.role, blocks, stamps)

    def _load(self, key: FileKey, block: int) -> memoryview | None:
        """The block's bytes if a good entry holds them (no lock), kept; a bad entry is dropped."""
        role = self._mapped_role(key)
        try:  # read before the entry is: never newer than it
            stamp = int(role.present(block, block + 1)[0]) if role is not None else 0
        except OSError:
            stamp = 0
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

    def _mapped_role(self, key: FileKey) -> RoleArrays | None:
        """The role's arrays open in this process (once; no lock needed to read a complete role's), or None
        when the cache has no complete role for ``key``."""
        role = self._roles.get(key[:2])
        if role is None:
            path = f"{self.data}/{key.sha}/{key.role}"
            try:
                if not os.path.exists(path + ".json"):
                    return None
                role = RoleArrays(path, folder_.block_count(key.size, self.block_size))
            except OSError:
                return None
            role = self._roles.setdefault(key[:2], role)  # another thread's, if it was first
        return role

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
        process holds the lock now (a store under way adds them itself). Nothing once the process stopped storing
        (it takes no lock then)."""
        if os.getpid() != self._pid or not any(self.counters.values()) or not self._lock.acquire(blocking=wait):
            return
        try:
            if not self.off:
                with self.accounting.hold() as state:
                    self._flush(state)
        except LockTimeout as error:
            self._turn_off(str(error), "resume or end that process")
        except OSError as error:
            self._turn_off(f"cannot count its reads: {error.strerror or error}", "check the disk")
        finally:
            self._lock.release()

    def _flush(self, state: dict[str, Any]) -> None:
        with self._counting:
            for name, amount in self.counters.items():
                state["run"][name] = state["run"].get(name, 0) + amount
                self.counters[name] = 0
            self._flushed = time.monotonic()

    def _at_exit(self) -> None:
        self.flush()
        if self.off is not None and os.getpid() == self._pid:
            print(f"mmidx: cache {self.data}: this process stored nothing there {self.off}", file=sys.stderr)
