"""When each block of a remote file is read next: the order in which the data cache evicts (Belady's).

A pack's samples are a pure function of (config, seed, pack), and so are the packs a node's ranks train on at
each micro-step (:class:`mmidx.train.loader.NodeSchedule`): every process of the node computes, with no message
to the others, the same answer to "which step reads block b of file f next". :class:`NextUse` answers it for the
cache (:class:`mmidx.io.block_cache.BlockCache`), which evicts the blocks read furthest ahead; :func:`simulate`
replays a whole run through that policy and through LRU, for the hit rates the storage guide quotes.

A *use* is a (block, step) pair: some sample of some pack of that step has bytes in the block. Uses are kept
per file as one sorted ``int64`` array of ``block << 32 | step``, so the next use of many blocks after a step is
one ``searchsorted``.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mmidx.io.block_store import HEADROOM, NEVER, keep_nearest
from mmidx.io.cache_folder import block_bytes, entry_bytes

Key = tuple[str, str]  # a file as the cache names it: (sha, role)
RangesOf = Callable[[int, int, np.ndarray], dict[Key, tuple[np.ndarray, np.ndarray, np.ndarray]]]
WINDOW_STEPS = 256  # steps added to the window at a time
MAX_USES = 2_000_000  # uses a process keeps (16 MB): further steps count as never
STEP = 1 << 32


def spans(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``first[i], first[i] + 1, ..., first[i] + counts[i] - 1`` for every i, concatenated."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.repeat(np.asarray(first, dtype=np.int64), counts) + np.arange(counts.sum()) - \
        np.repeat(np.cumsum(counts) - counts, counts)


def block_uses(packs: Any, steps: Sequence[int], packs_at: Callable[[int], Sequence[int]], ranges_of: RangesOf,
               block_size: int) -> dict[Key, np.ndarray]:
    """Every use of ``steps``, per file, sorted: the blocks of the byte ranges (``ranges_of(group, dataset,
    samples)``) of the samples of the packs each step trains on (``packs_at(step)``, items from ``packs``)."""
    by_dataset: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for step in steps:
        for pack in packs_at(step):
            for item in packs.items(pack):
                samples, when = by_dataset.setdefault((item.group, item.dataset), ([], []))
                samples.append(item.sample)
                when.append(step)
    found: dict[Key, list[np.ndarray]] = {}
    for (group, dataset), (samples, when) in by_dataset.items():
        for key, (starts, stops, owners) in ranges_of(group, dataset, np.array(samples, dtype=np.int64)).items():
            first, counts = starts // block_size, (stops - 1) // block_size - starts // block_size + 1
            uses = spans(first, counts) * STEP + np.repeat(np.asarray(when, dtype=np.int64)[owners], counts)
            found.setdefault(key, []).append(uses)
    return {key: np.unique(np.concatenate(parts)) for key, parts in found.items()}


def next_reads(uses: np.ndarray, blocks: np.ndarray, after: int) -> np.ndarray:
    """The first step at or after ``after`` using each of ``blocks`` (``NEVER``: none in ``uses``)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    if len(uses) == 0 or len(blocks) == 0:
        return np.full(len(blocks), NEVER, dtype=np.int64)
    at = np.searchsorted(uses, blocks * STEP + max(after, 0))
    found = uses[np.minimum(at, len(uses) - 1)]
    return np.where((at < len(uses)) & (found // STEP == blocks), found % STEP, NEVER)


class NextUse:
    """The cache's eviction policy in one process: the next use of any block, from a window of steps ahead of
    the step this process builds (:meth:`at`), rebuilt as it moves; a block no step of the window reads is
    ``NEVER`` read (the cache then evicts the least recently used of those first).

    ``packs_at(step)``: the packs of a step (the node's ranks'); ``steps``: the run's steps; ``step_of(pack)``:
    the step of a pack; ``limit``: the cache's, which the window's distinct blocks should cover twice over.
    """

    def __init__(self, packs: Any, ranges_of: RangesOf, packs_at: Callable[[int], Sequence[int]], steps: range,
                 step_of: Callable[[int], int | None], block_size: int, limit: int):
        self.packs, self.ranges_of, self.packs_at, self.steps = packs, ranges_of, packs_at, steps
        self.step_of, self.block_size, self.limit = step_of, block_size, limit
        self.now = self.front = steps.start
        self.window = range(0)
        self.uses: dict[Key, np.ndarray] = {}
        self._warned = False

    def at(self, step: int, front: int | None = None) -> None:
        """This process builds ``step`` now and has fetched the packs of steps up to ``front`` (default ``step``).
        The window is first built when the cache asks (a cache that never evicts never pays for it), then moved
        here, outside the cache's lock, once it is half behind."""
        self.now, self.front = step, max(step, step if front is None else front)
        if self.window:
            self._follow()

    def _follow(self) -> None:
        """Move the window to the step built now, once it is half behind."""
        step = self.now
        inside = self.window.start <= step < self.window.stop
        if inside and ((step - self.window.start) * 2 < len(self.window) or self.window.stop >= self.steps.stop):
            return
        first = max(step, self.steps.start)
        stop, uses, distinct = first, {}, 0
        while stop < self.steps.stop and sum(map(len, uses.values())) < MAX_USES and distinct < 2 * self.limit:
            chunk = range(stop, min(stop + WINDOW_STEPS, self.steps.stop))
            for key, found in block_uses(self.packs, chunk, self.packs_at, self.ranges_of, self.block_size).items():
                uses[key] = np.concatenate([uses[key], found]) if key in uses else found
            distinct = sum(len(np.unique(found // STEP)) for found in uses.values()) * self.block_size
            self._warn(chunk)
            stop = chunk.stop
        self.window, self.uses = range(first, stop), {key: np.sort(found) for key, found in uses.items()}

    def next_use(self, key: Key, blocks: np.ndarray, pack: int | None) -> np.ndarray:
        """The step whose fetch reads each of ``blocks`` of ``key`` next: after ``pack``'s step for blocks just
        fetched for it, else from the front of this process's fetches on. The cache is read when packs are
        fetched, some steps ahead of their build, and a fetched pack's bytes are in memory: the steps before
        the front read nothing more from it (each process of the node fetches as far ahead)."""
        self._follow()
        step = None if pack is None else self.step_of(pack)
        after = self.front if step is None else step + 1
        return next_reads(self.uses.get(key, np.zeros(0, np.int64)), blocks, after)

    def _warn(self, steps: range) -> None:
        """One line, once, if a step of ``steps`` reads more blocks than the limit holds."""
        if self._warned or not len(steps):
            return
        uses = block_uses(self.packs, steps[:1], self.packs_at, self.ranges_of, self.block_size)
        needed = sum(len(found) for found in uses.values()) * self.block_size
        if needed > self.limit:
            self._warned = True
            print(f"mmidx: cache limit {self.limit:,} bytes is below the {needed:,} bytes of blocks step {steps[0]} "
                  "reads: most reads bypass the cache (give a limit of several steps' blocks)", file=sys.stderr)


def simulate(uses: dict[Key, np.ndarray], sizes: dict[Key, int], block_size: int, limit: int,
             policy: str) -> dict[str, float]:
    """Replay every use, step by step, through a cache of ``limit`` bytes: ``policy`` "next-use" (the cache's
    own eviction, :func:`~mmidx.io.block_store.keep_nearest` on :func:`next_reads`) or "lru" (the textbook
    least recently used). Entries count as the cache counts them; the hit rate is in bytes read; ``gets`` counts
    a request per run of neighbouring blocks a step misses (what the cache fetches in one)."""
    keys = sorted(uses)
    base = np.cumsum([0] + [-(-sizes[key] // block_size) for key in keys])
    ids = np.concatenate([base[i] + uses[key] // STEP for i, key in enumerate(keys)] or [np.zeros(0, np.int64)])
    when = np.concatenate([uses[key] % STEP for key in keys] or [np.zeros(0, np.int64)])
    read = np.concatenate([block_bytes(sizes[key], block_size, np.arange(base[i + 1] - base[i]))
                           for i, key in enumerate(keys)] or [np.zeros(0, np.int64)])
    stored = np.concatenate([entry_bytes(sizes[key], block_size, np.arange(base[i + 1] - base[i]))
                             for i, key in enumerate(keys)] or [np.zeros(0, np.int64)])
    table = np.sort(ids * STEP + when)
    order = np.argsort(when, kind="stable")
    ordered_ids, ordered_steps = ids[order], when[order]
    bounds = np.flatnonzero(np.diff(ordered_steps)) + 1
    firsts = np.concatenate([[0], bounds]).astype(np.int64) if len(order) else np.zeros(0, np.int64)
    hits = total = used = gets = 0
    present = np.zeros(len(read), dtype=bool)
    touched = np.zeros(len(read), dtype=np.int64)
    lru: OrderedDict[int, None] = OrderedDict()
    for step, step_ids in zip(ordered_steps[firsts].tolist(), np.split(ordered_ids, bounds), strict=True):
        step_ids = np.unique(step_ids)
        hit = present[step_ids]
        hits += int(read[step_ids[hit]].sum())
        total += int(read[step_ids].sum())
        touched[step_ids] = step + 1
        new = step_ids[~hit]
        gets += int(len(new) > 0) + int(np.count_nonzero(np.diff(new) != 1))
        if policy == "lru":  # a step's blocks used in ascending order, then the least recent evicted
            for number in step_ids.tolist():
                if number in lru:
                    lru.move_to_end(number)
                else:
                    lru[number] = None
                    used += int(stored[number])
            present[new] = True
            while used > limit:
                number, _ = lru.popitem(last=False)
                used -= int(stored[number])
                present[number] = False
            continue
        if used + int(stored[new].sum()) > limit:  # the cache's own choice: keep what is read soonest
            held = np.flatnonzero(present)
            pool = np.concatenate([held, new])
            next_use = np.concatenate([next_reads(table, held, step), next_reads(table, new, step + 1)])
            keep = keep_nearest(next_use, touched[pool], stored[pool], limit, limit // HEADROOM)
            present[held[~keep[:len(held)]]] = False
            new = new[keep[len(held):]]
            used = int(stored[present].sum())
        present[new] = True
        used += int(stored[new].sum())
    return {"hit_rate": hits / total if total else 0.0, "bytes_read": total, "bytes_hit": hits, "gets": gets}
