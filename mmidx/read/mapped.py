"""How many datasets a process keeps mapped at once: at most ``MMIDX_MAX_MAPPED`` (default: what half of the
kernel's maps per process hold, 8,191 at Linux's default: :func:`default_limit`), the least recently used unmapped
first.

A dataset maps two to four files (:mod:`mmidx.read.dataset`), each one memory map and no file descriptor. A
process reading a sharded dataset of 50,000 shards, or a data config of 10,000 datasets, would otherwise keep
every one it touched mapped, up to the kernel's limit on maps per process (``vm.max_map_count``, 65,530 by
default), where the next map fails. An unmapped dataset maps its files again when it is next read; arrays
already handed out keep their own map alive, so nothing is ever unmapped under a reader.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Any

MAPS_PER_DATASET = 4  # .idx, .bin, .images, .plan
SHARE_OF_MAPS = 2  # at most half the kernel's maps per process for datasets; the rest for libraries and arrays


def default_limit(max_map_count_path: str = "/proc/sys/vm/max_map_count") -> int:
    """How many datasets stay mapped by default: as many as half the kernel's maps per process hold (8,191 at
    Linux's default 65,530, so a sharded dataset of 10^8 samples in 20,000-sample shards stays mapped whole), at
    least 1,024."""
    try:
        with open(max_map_count_path) as stream:
            maps = int(stream.read())
    except (OSError, ValueError):
        maps = 65530
    return max(1024, maps // (MAPS_PER_DATASET * SHARE_OF_MAPS))


def _limit() -> int:
    text = os.environ.get("MMIDX_MAX_MAPPED", "")
    try:
        value = int(text) if text else default_limit()
    except ValueError:
        value = default_limit()
    return max(value, 1)


class MappedDatasets:
    """The datasets this process has mapped, least recently used first; ``used(dataset)`` after each mapping or
    read keeps at most ``limit`` mapped, calling ``unmap()`` on the oldest."""

    def __init__(self, limit: int):
        self.limit = limit
        self._order: OrderedDict[int, weakref.ref] = OrderedDict()
        self._lock = threading.Lock()
        self._last = 0

    def used(self, dataset: Any) -> None:
        key = id(dataset)
        if key == self._last:  # the common case, without the lock: the same dataset read again
            return
        evicted = []
        with self._lock:
            self._last = key
            if key in self._order:
                self._order.move_to_end(key)
            else:
                self._order[key] = weakref.ref(dataset, lambda _, key=key: self._forget(key))
            while len(self._order) > self.limit:
                _, oldest = self._order.popitem(last=False)
                evicted.append(oldest())
        for other in evicted:
            if other is not None:
                other.unmap()

    def _forget(self, key: int) -> None:
        with self._lock:
            self._order.pop(key, None)
            if self._last == key:
                self._last = 0

    def __len__(self) -> int:
        return len(self._order)


MAPPED = MappedDatasets(_limit())
