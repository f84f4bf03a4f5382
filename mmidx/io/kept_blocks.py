"""``KeptBlocks``: the checked blocks of the node's data cache that one process keeps in memory, within a bound.

A read through the cache (:class:`mmidx.io.block_cache.BlockCache`) that opened each block's entry, read it and
checked its digest every time cost more than the read of a local file, whose pages are mapped once. So a
process keeps the bytes of the blocks it read back and checked, or fetched and stored, least recently read going
first beyond ``limit`` bytes, and serves them again with no system call, while the cache still holds the entry
they were checked from: each carries its entry's ``present`` stamp (when it was stored), and a block another
process evicted (stamp 0) or stored again (another stamp) is read from the cache again, so hits and misses are
the cache's own. An entry is a pure function of its key (dataset ``meta_sha256``, file, block), so bytes kept
are right even when the entry changes meanwhile.

Kept bytes are private memory, not a mapping of the entry: they pin no disk space after another process evicts
the entry, they cannot change after their check (a file written over by hand, a disk error), and a file
truncated under them cannot end the process with SIGBUS. The cost is memory: at most ``limit`` bytes a process
(:data:`mmidx.io.block_cache.KEPT_BYTES`), plus the views still held by packs being built.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np


class Kept(NamedTuple):
    """A block a process keeps: its bytes, checked (read-only), and its entry's ``present`` stamp when checked."""

    data: memoryview
    stamp: int


class KeptBlocks:
    """The blocks one process keeps, by (sha, role, block), least recently read first, at most ``limit`` bytes."""

    def __init__(self, limit: int):
        self.limit, self.bytes = limit, 0
        self._blocks: OrderedDict[tuple[str, str, int], Kept] = OrderedDict()
        self._lock = threading.Lock()  # the process's fetch threads and its main thread

    def get(self, sha: str, role: str, blocks: range, present: np.ndarray) -> list[memoryview | None]:
        """The bytes of each of ``blocks`` kept from the entry the cache holds now (``present``: the role's
        stamps), None for the others."""
        found: list[memoryview | None] = []
        with self._lock:
            for block in blocks:
                kept = self._blocks.get((sha, role, block))
                if kept is not None and present[block] == kept.stamp:
                    self._blocks.move_to_end((sha, role, block))
                    found.append(kept.data)
                else:
                    found.append(None)
        return found

    def put(self, sha: str, role: str, blocks: Iterable[tuple[int, memoryview, int]]) -> None:
        """Keep checked ``(block, bytes, stamp)``s (a stamp of 0, an entry not known to be in the cache, is not
        kept), dropping the least recently read beyond the limit."""
        with self._lock:
            for block, data, stamp in blocks:
                if not stamp:
                    continue
                old = self._blocks.pop((sha, role, block), None)
                self.bytes += len(data) - (0 if old is None else len(old.data))
                self._blocks[(sha, role, block)] = Kept(data, stamp)
            while self.bytes > self.limit:
                self.bytes -= len(self._blocks.popitem(last=False)[1].data)


def joined(parts: list[memoryview], offset: int, length: int) -> memoryview:
    """``length`` bytes from ``offset`` of ``parts`` laid end to end: a view of the first part when they lie in
    it, else one copy of each piece into a new buffer."""
    if offset + length <= len(parts[0]):
        return parts[0][offset:offset + length]
    out, position = bytearray(length), 0
    for part in parts:
        piece = part[offset:offset + length - position]
        out[position:position + len(piece)] = piece
        position, offset = position + len(piece), 0
    return memoryview(out).toreadonly()
