"""``RoleArrays``: a cached file's two arrays in the node's data cache (``SHA/ROLE.present`` and ``.used``, one
uint64 a block: when the block was stored, 0 when absent; when it was last read), open in one process.

They are read and written with ``pread`` and ``pwrite``, as copies, never mapped: a file truncated under a
mapping (by hand, by a tool cleaning the disk, by a filesystem error) kills a reader that touches a page past its
new end with SIGBUS, which no Python code can recover from. A short read here is a role whose blocks are absent
(its readers fetch and read entries again) and :meth:`RoleArrays.intact` false, which the next store sees: the
folder is then repaired under its lock (:func:`mmidx.io.cache_accounting.repair`). A read of the stamps of the
blocks a read needs is one system call (``pread`` of 8 bytes a block), and its hint another (``pwrite``).
"""

from __future__ import annotations

import os

import numpy as np

STAMP = 8  # bytes a block takes in each array


class RoleArrays:
    """The arrays of the role at ``path`` (``path.present``, ``path.used``) for a file of ``count`` blocks, open in
    this process until the object goes (never closed under a thread still reading it: a descriptor number reused
    by another file would read or write that file). ``present`` changes under the folder's lock; ``used`` is a
    hint."""

    def __init__(self, path: str, count: int):
        self.path, self.count = path, count
        self._fds: list[int] = []
        try:
            for suffix in ("present", "used"):
                self._fds.append(os.open(f"{path}.{suffix}", os.O_RDWR))
                if os.fstat(self._fds[-1]).st_size != STAMP * count:
                    raise OSError(f"{path}.{suffix}: not {count} blocks")
        except OSError:
            self.__del__()
            raise
        self.inode = os.fstat(self._fds[0]).st_ino

    def present(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The stored stamps of blocks [start, stop) (all by default): a copy, 0 for blocks past a truncated end."""
        return self._read(0, start, self.count if stop is None else stop)

    def used(self) -> np.ndarray:
        """Every block's last read (the hint), a copy."""
        return self._read(1, 0, self.count)

    def set_present(self, blocks: list[int], stamp: int) -> None:
        """Record ``blocks`` as stored at ``stamp`` (0: evicted); under the folder's lock."""
        raw = np.uint64(stamp).tobytes()
        for block in blocks:
            os.pwrite(self._fds[0], raw, STAMP * block)

    def stamps(self, start: int, stop: int) -> list[int]:
        """:meth:`present` of blocks [start, stop) as integers, in one ``pread`` (a read's check of its kept blocks)."""
        raw = os.pread(self._fds[0], STAMP * (stop - start), STAMP * start)
        found = memoryview(raw[:len(raw) - len(raw) % STAMP]).cast("Q").tolist()
        return found + [0] * (stop - start - len(found))

    def touch(self, start: int, stop: int, stamp: int) -> None:
        """Record blocks [start, stop) as read at ``stamp`` (the hint eviction orders equals by), in one ``pwrite``
        (past a truncated end it leaves a file of the wrong size, which the next store finds)."""
        os.pwrite(self._fds[1], stamp.to_bytes(STAMP, "little") * (stop - start), STAMP * start)

    def intact(self) -> bool:
        """Whether both arrays still have a stamp for every block (nothing truncated them)."""
        return all(os.fstat(fd).st_size == STAMP * self.count for fd in self._fds)

    def __del__(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def _read(self, which: int, start: int, stop: int) -> np.ndarray:
        stamps = np.zeros(max(0, stop - start), dtype=np.uint64)
        raw = os.pread(self._fds[which], STAMP * len(stamps), STAMP * start) if len(stamps) else b""
        got = len(raw) // STAMP
        stamps[:got] = np.frombuffer(raw, dtype=np.uint64, count=got)
        return stamps
