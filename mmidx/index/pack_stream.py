"""Streamed packing — ``PackStream``: the packs of :func:`~mmidx.index.stream.multimodal_stream` →
:func:`~mmidx.index.stream.stream_views` → :func:`~mmidx.index.packer.pack_samples`, item for item (as sample
numbers and views), computed a chunk at a time.

Guarantee: the blend's counts, the packer's buffer, open pack and mandatory queues carry over chunk
boundaries, so memory is the chunk and the view tables, whatever the stream's length.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmidx import _blending, _stream
from mmidx.index.blend import _normalize
from mmidx.index.packer import _check_budgets, _check_kernel, _check_policy, _packer, packing_stats
from mmidx.index.stream import ViewTable, _group_keys


@dataclass(frozen=True)
class PackChunk:
    """Packs closed while the stream advanced by one chunk: pack k of the chunk holds items
    ``pack_ends[k-1]:pack_ends[k]`` of ``samples`` / ``views`` (numbered as in the ViewTable)."""

    samples: np.ndarray
    views: np.ndarray
    pack_ends: np.ndarray
    tokens: int
    excluded: int
    stream_position: int


class _Cursor:
    """A place in the blended stream: its position and the blend's per-group counts so far."""

    def __init__(self, position: int, taken: np.ndarray):
        self.position = position
        self.taken = taken

    def copy(self) -> _Cursor:
        return _Cursor(self.position, self.taken.copy())


class PackStream:
    """The packs of ``multimodal_stream`` → ``stream_views`` → ``pack_samples``, computed a chunk of
    the stream at a time in memory bounded by the chunk size (and the view table), equal to that
    whole-array pipeline pack for pack. Iterate for ``PackChunk`` s; ``stats`` afterwards.

    A mandatory group whose next item lies beyond the current chunk is read ahead by a cursor of its
    own, a chunk at a time, keeping only that group's items: its queue never holds more than a
    chunk's worth of them.
    """

    def __init__(self, table: ViewTable, weights: np.ndarray | list[float], num_samples: int, seed: int, *,
                 mandatory: np.ndarray | list[bool], max_num_tokens: int, expected_num_tokens: int,
                 max_num_tokens_per_sample: int, prefer_buffer_before: int, max_buffer_size: int,
                 chunk_size: int = 1 << 20, policy: str = "bagel", window: int = 128):
        self.table = table
        self.weights = _normalize(weights)
        if len(self.weights) != table.num_groups or len(mandatory) != table.num_groups:
            raise ValueError("weights, mandatory and the view table need one entry per group")
        if num_samples < 0 or chunk_size < 1:
            raise ValueError(f"num_samples must be >= 0 and chunk_size >= 1, got {num_samples}, {chunk_size}")
        self.num_samples = int(num_samples)
        self.chunk_size = int(chunk_size)
        self.group_sizes = np.diff(table.group_base)
        self.group_keys = _group_keys(seed, table.num_groups)
        self.key_stride = table.max_views
        self.mandatory = np.asarray(mandatory, dtype=bool)
        _check_budgets(max_num_tokens, expected_num_tokens, max_num_tokens_per_sample, prefer_buffer_before,
                       max_buffer_size)
        self.budgets = (max_num_tokens, expected_num_tokens)
        self.packer = _packer(self.mandatory, max_num_tokens, expected_num_tokens, max_num_tokens_per_sample,
                              prefer_buffer_before, max_buffer_size, self.num_samples,
                              tight=_check_policy(policy, window), window=window)
        self.stats: dict[str, Any] = {}
        self.group_counts: list[int] = []  # stream items of each group, once iterated

    def _chunk(self, cursor: _Cursor, length: int, only: int | None = None) -> tuple[np.ndarray, ...]:
        """(groups, token counts, keys) of the next ``length`` stream items (of group ``only``)."""
        groups = np.empty(length, dtype=np.int32)
        ranks = np.empty(length, dtype=np.int64)
        _blending.build_blending_indices(self.weights, groups, ranks, cursor.taken, cursor.position)
        cursor.position += length
        if only is not None:
            chosen = groups == only
            groups, ranks = groups[chosen], ranks[chosen]
        n = len(groups)
        samples, epochs = np.empty(n, np.int64), np.empty(n, np.int64)
        _stream.stream_samples(groups, ranks, self.group_sizes, self.group_keys, samples, epochs)
        views, counts, keys = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int64)
        t = self.table
        _stream.item_views(groups, samples, epochs, t.group_base, t.view_offsets, t.view_tokens, self.key_stride,
                           views, counts, keys)
        return groups, counts, keys

    def _lookahead(self, cursor: _Cursor, groups: np.ndarray, counts: np.ndarray, keys: np.ndarray,
                   take: np.ndarray) -> None:
        _check_kernel(self.packer.lookahead(counts, groups, keys, take.view(np.uint8)), "view token counts", counts)
        if cursor.position == self.num_samples:
            for group in np.flatnonzero(take):
                self.packer.end_lookahead(int(group))

    def __iter__(self) -> Iterator[PackChunk]:
        packer = self.packer
        main = _Cursor(0, np.zeros(self.table.num_groups))
        mandatory = np.flatnonzero(self.mandatory)
        ahead = {int(g): main.copy() for g in mandatory}  # where each group's lookahead has reached
        while main.position < self.num_samples:
            start = main.position
            groups, counts, keys = self._chunk(main, min(self.chunk_size, self.num_samples - start))
            take = np.zeros(self.table.num_groups, dtype=bool)
            for group, cursor in ahead.items():
                if cursor.position == start:
                    take[group] = True
                    ahead[group] = main.copy()
            if take.any():
                self._lookahead(main, groups, counts, keys, take)
            begin = 0
            while True:
                begin, needed = packer.feed(counts, groups, keys, start, begin)
                if needed == -1:
                    break
                if needed < -1:
                    raise ValueError(f"stream item {-2 - needed} has a negative view token count")
                cursor = ahead[needed]
                only = self._chunk(cursor, min(self.chunk_size, self.num_samples - cursor.position), needed)
                self._lookahead(cursor, *only, take=np.arange(self.table.num_groups) == needed)
            yield self._drain(main.position)
        for group in mandatory:  # an empty stream never reached the lookahead
            packer.end_lookahead(int(group))
        packer.finish()
        yield self._drain(main.position)
        self.stats = packing_stats(packer, *self.budgets)
        self.group_counts = main.taken.astype(np.int64).tolist()

    def _drain(self, position: int) -> PackChunk:
        keys, ends, tokens, excluded = self.packer.drain()
        samples, views = np.divmod(keys, self.key_stride)
        return PackChunk(samples, views, ends, int(tokens.sum()), len(excluded), position)


