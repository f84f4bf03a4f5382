"""Storing and evicting in a node's data cache (:class:`~mmidx.io.block_cache.BlockCache`), under the folder's lock:
the half of the cache that changes what it holds, and the order in which it evicts.

Eviction keeps what is needed soonest: a policy (:mod:`mmidx.read.next_use`, which knows the steps ahead from
the pack order) gives each block the step that reads it next, and when a block must make room, the blocks read
furthest ahead go first (Belady's policy), least recently used first among equals (so without a policy the
cache is LRU). A fetched block whose next use is further than everything cached is not stored (its read is
served anyway). Processes of one node evict by the same order: each computes it from the same schedule.

Every change is made holding the folder's lock (:class:`~mmidx.io.cache_accounting.Accounting`), which keeps the
folder within its limit; a role whose arrays were found truncated has the folder repaired first. A lock not had
within its wait, or a write that fails (a full disk), turns storing off for the process (``_turn_off``, the
cache's): it goes on reading what is cached, and fetching the rest.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np
import xxhash

from mmidx.io import cache_folder as folder_
from mmidx.io.cache_accounting import Accounting, repair
from mmidx.io.cache_folder import MAGIC
from mmidx.io.kept_blocks import KeptBlocks
from mmidx.io.lock import LockTimeout
from mmidx.io.role_arrays import RoleArrays

NEVER = np.iinfo(np.int64).max  # the next use of a block no step ahead reads
HEADROOM = 32  # an eviction frees 1/HEADROOM of the limit beyond what it needs, so evictions come in batches


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


def digest(key: FileKey, block: int, data: bytes | memoryview) -> bytes:
    """An entry's digest: xxh3-64 of its key and its bytes (an entry renamed to another block fails it too)."""
    state = xxhash.xxh3_64(f"{key.sha}/{key.role}/{block}".encode())
    state.update(data)
    return state.digest()


class BlockStore:
    """What changes the cache's folder, under its lock: the storing and evicting half of
    :class:`~mmidx.io.block_cache.BlockCache`, which sets the attributes below."""

    data: Any
    limit: int
    block_size: int
    policy: EvictionPolicy | None
    counters: dict[str, int]
    off: str | None
    accounting: Accounting
    kept: KeptBlocks
    _roles: dict[tuple[str, str], RoleArrays]
    _repairs: int
    _names: Iterator[int]
    _lock: threading.Lock
    _flush: Callable[[dict[str, Any]], None]

    def _path(self, key: FileKey, block: int) -> str:
        return f"{self.data}/{key.sha}/{key.role}/{block}"

    def _store(self, key: FileKey, blocks: dict[int, memoryview], pack: int | None) -> None:
        stored: list[tuple[int, memoryview, int]] = []
        try:
            with self._lock:
                if self.off:
                    return
                with self.accounting.hold() as state:  # a failure leaves it busy: the next holder repairs
                    self._flush(state)
                    role = self._role(state, key)
                    if role is None:  # the limit cannot hold the file's arrays
                        self.counters["bypassed"] += len(blocks)
                        return
                    present = role.present(min(blocks), max(blocks) + 1)
                    new = np.array([block for block in blocks if not present[block - min(blocks)]], dtype=np.int64)
                    sizes = folder_.entry_bytes(key.size, self.block_size, new)
                    if state["bytes"] + int(sizes.sum()) > self.limit:
                        kept = self._make_room(state, key, new, pack)
                        self.counters["bypassed"] += len(kept) - int(kept.sum())
                        new, sizes = new[kept], sizes[kept]
                    for block, accounted in zip(new.tolist(), sizes.tolist(), strict=True):
                        self._write(key, block, blocks[block])
                        state["bytes"] += accounted
                        stamp = time.time_ns()
                        role.set_present([block], stamp)
                        stored.append((block, blocks[block], stamp))
        except LockTimeout as error:
            self._turn_off(str(error), "resume or end that process")
        except OSError as error:  # a full disk, a folder made read-only: go on uncached
            self._turn_off(f"cannot store a block: {error.strerror or error}",
                           "free space or give another --cache-dir")
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

    def _role(self, state: dict[str, Any], key: FileKey) -> RoleArrays | None:
        """The role's arrays, open in this process; its files created first (counted, room made for them) if
        the cache lacks them; None when the limit cannot hold them. Arrays found truncated have the folder
        repaired first."""
        path = f"{self.data}/{key.sha}/{key.role}"
        mapped = self._roles.get(key[:2])
        try:
            if mapped is not None and os.stat(path + ".present").st_ino == mapped.inode and os.path.isdir(path):
                if mapped.intact():
                    return mapped
                self._repair(state)  # truncated: every role's arrays rebuilt
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
            for suffix in ("present", "used"):  # new files, renamed: a process with an old one open keeps it
                fresh = self.data / "tmp" / f"{os.getpid()}.{next(self._names)}"
                try:
                    with open(fresh, "wb") as stream:
                        stream.truncate(8 * count)
                    os.replace(fresh, f"{path}.{suffix}")
                finally:
                    fresh.unlink(missing_ok=True)
            with open(path + ".json", "w") as stream:  # last: the role is complete
                stream.write(described)
        try:
            self._roles[key[:2]] = RoleArrays(path, count)
        except OSError:  # arrays of the wrong size
            self._repair(state)
            self._roles[key[:2]] = RoleArrays(path, count)
        return self._roles[key[:2]]

    def _repair(self, state: dict[str, Any]) -> None:
        """Rebuild the accounting and every role's arrays from the files (under the lock)."""
        state.update(repair(self.data, self.block_size, state["run"]), busy=1)
        self._repairs += 1

    def _make_room(self, state: dict[str, Any], key: FileKey | None, new: np.ndarray, pack: int | None) -> np.ndarray:
        """Evict the entries read furthest ahead until the ``new`` blocks of ``key`` that are read sooner fit, with
        headroom; which of ``new`` to store."""
        repairs = self._repairs
        stored, next_use, touched, sizes = self._entries(state)
        if self._repairs != repairs:  # arrays found damaged were rebuilt meanwhile: read them again
            stored, next_use, touched, sizes = self._entries(state)
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
            evicted = blocks[~keep[position:position + len(blocks)]].tolist()
            role.set_present(evicted, 0)
            for block in evicted:
                try:
                    os.unlink(self._path(probe, block))
                except FileNotFoundError:
                    pass
                state["bytes"] -= int(folder_.entry_bytes(probe.size, self.block_size, [block])[0])
                self.counters["evicted"] += 1
            position += len(blocks)
        return keep[position:]

    def _entries(self, state: dict[str, Any]) -> tuple[list[tuple[RoleArrays, np.ndarray, FileKey]], ...]:
        """Every entry of the cache, by role: (its arrays, its blocks, its key), and each entry's next use, last
        touch and size."""
        stored: list[tuple[RoleArrays, np.ndarray, FileKey]] = []
        next_use, touched, sizes = [np.zeros(0, np.int64)], [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
        for sha, name, meta in folder_.roles(self.data):
            probe = FileKey(sha, name, str(meta.get("uri")), meta["dataset"], meta["bytes"])
            role = self._role(state, probe)
            if role is None:
                continue
            present = role.present()
            blocks = np.flatnonzero(present)
            stored.append((role, blocks, probe))
            next_use.append(self._next_use((sha, name), blocks, None))
            touched.append(np.maximum(present[blocks], role.used()[blocks]))
            sizes.append(folder_.entry_bytes(meta["bytes"], self.block_size, blocks))
        return stored, next_use, touched, sizes

    def _next_use(self, key: tuple[str, str], blocks: np.ndarray, pack: int | None) -> np.ndarray:
        if self.policy is None or len(blocks) == 0:
            return np.full(len(blocks), NEVER, dtype=np.int64)
        return np.asarray(self.policy.next_use(key, blocks, pack), dtype=np.int64)

    def _drop(self, key: FileKey, block: int, inode: int) -> None:
        """Remove a bad entry, if the path still holds that file (another process may have replaced it)."""
        try:
            with self._lock:
                if self.off:
                    return
                with self.accounting.hold() as state:
                    self.counters["dropped"] += 1
                    try:
                        if os.stat(self._path(key, block)).st_ino != inode:
                            return
                        os.unlink(self._path(key, block))
                    except FileNotFoundError:
                        return
                    exists = os.path.exists(f"{self.data}/{key.sha}/{key.role}.json")
                    role = self._role(state, key) if exists else None
                    if role is not None and role.present(block, block + 1)[0]:
                        role.set_present([block], 0)
                        state["bytes"] -= int(folder_.entry_bytes(key.size, self.block_size, [block])[0])
        except LockTimeout as error:
            self._turn_off(str(error), "resume or end that process")
        except OSError as error:
            self._turn_off(f"cannot drop a bad block: {error.strerror or error}", "check the disk")

    def _turn_off(self, why: str, remedy: str) -> None:
        """Stop storing, and taking the folder's lock, for the rest of the process, saying why (once, and again at
        its end: :meth:`BlockCache._at_exit`); the blocks already cached are still read."""
        if self.off is None:
            self.off = f"from {time.strftime('%H:%M:%S')} on ({why})"
            print(f"mmidx: cache {self.data}: {why}; this process stores nothing more there from now on (it reads "
                  f"the blocks cached, and fetches the rest) ({remedy})", file=sys.stderr)
