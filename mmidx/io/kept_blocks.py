"""``KeptBlocks``: the checked blocks of the node's data cache that one process keeps in memory, within a bound;
``Fetching``: the blocks its threads are fetching, which a second reader waits for.

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

A process's fetch threads read several packs' ranges at once, and packs share blocks (the token file's above
all): two threads missing the same cold block would both fetch it. The first to miss it claims it
(:meth:`Fetching.claim`), the second waits for that fetch and takes its bytes; a fetch that fails leaves each
waiter to fetch the block itself. A thread fetches what it claimed before it waits for others' claims, so
no two threads wait for each other.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import NamedTuple


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

    def get(self, sha: str, role: str, blocks: range, stamps: list[int]) -> list[memoryview | None]:
        """The bytes of each of ``blocks`` kept from the entry the cache holds now (``stamps``: the role's
        ``present`` stamps of ``blocks``), None for the others."""
        found: list[memoryview | None] = []
        with self._lock:
            for block, stamp in zip(blocks, stamps, strict=True):
                kept = self._blocks.get((sha, role, block))
                if kept is not None and stamp == kept.stamp:
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


class Fetching:
    """The blocks this process's threads are fetching, by (sha, role, block)."""

    def __init__(self) -> None:
        self._flights: dict[tuple[str, str, int], Future] = {}
        self._lock = threading.Lock()

    def claim(self, sha: str, role: str, blocks: list[int]) -> tuple[list[int], list[tuple[int, Future]]]:
        """Of ``blocks``, those no other thread is fetching, now this thread's to fetch (then :meth:`release`), and
        the others with the fetch to wait for (its result: the block's bytes, or None where it failed)."""
        mine, theirs = [], []
        with self._lock:
            for block in blocks:
                flight = self._flights.get((sha, role, block))
                if flight is None:
                    self._flights[(sha, role, block)] = Future()
                    mine.append(block)
                else:
                    theirs.append((block, flight))
        return mine, theirs

    def release(self, sha: str, role: str, fetched: Mapping[int, memoryview | None]) -> None:
        """End the fetches of the blocks claimed, handing each waiter its bytes (None: not fetched)."""
        with self._lock:
            flights = [self._flights.pop((sha, role, block)) for block in fetched]
        for flight, data in zip(flights, fetched.values(), strict=True):
            flight.set_result(data)


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
