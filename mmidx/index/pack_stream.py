"""Streamed packing — ``PackStream``: the packs of :func:`~mmidx.index.stream.multimodal_stream` →
:func:`~mmidx.index.stream.stream_views` → :func:`~mmidx.index.packer.pack_samples`, item for item (as sample
numbers and views), computed a chunk at a time.

Guarantee: the blend's counts, the packer's buffer, open pack and mandatory queues carry over chunk
boundaries, so memory is the chunk and the view tables, whatever the stream's length. With a schedule
(:mod:`mmidx.index.schedule`) a phase ends at the stream item whose packing closed its ``until_packs``-th
pack (or reached its ``until_tokens``): near a limit items are fed in steps too short to pass it, so the
boundary — and every pack — is the same whatever the chunk size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmidx import _stream
from mmidx.index.blend import _normalize
from mmidx.index.packer import DEFAULT_COST_SLACK, _check_budgets, _check_kernel, _check_policy, _packer, packing_stats
from mmidx.index.schedule import Phase, PhasedBlend
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


class PackStream:
    """The packs of ``multimodal_stream`` → ``stream_views`` → ``pack_samples``, computed a chunk of
    the stream at a time in memory bounded by the chunk size (and the view table), equal to that
    whole-array pipeline pack for pack. Iterate for ``PackChunk`` s; ``stats`` afterwards.

    A mandatory group whose next item lies beyond the current chunk is read ahead by a cursor of its
    own, a chunk at a time, keeping only that group's items: its queue never holds more than a
    chunk's worth of them. ``phases`` (optional) replaces ``weights`` by a schedule; ``phase_log`` holds,
    once iterated, each phase's start (stream position and packs closed) and items and tokens per group.
    """

    def __init__(self, table: ViewTable, weights: np.ndarray | list[float], num_samples: int, seed: int, *,
                 mandatory: np.ndarray | list[bool], max_num_tokens: int, expected_num_tokens: int,
                 max_num_tokens_per_sample: int, prefer_buffer_before: int, max_buffer_size: int,
                 chunk_size: int = 1 << 20, phases: list[Phase] | None = None, policy: str = "bagel",
                 window: int = 128, cost_slack: float | None = DEFAULT_COST_SLACK):
        self.table = table
        self.phases = [Phase(tuple(_normalize(weights)))] if phases is None else list(phases)
        if len(self.phases[0].weights) != table.num_groups or len(mandatory) != table.num_groups:
            raise ValueError("weights, mandatory and the view table need one entry per group")
        if len(self.phases) > 1 and any(mandatory):
            raise ValueError("is_mandatory groups cannot be combined with a schedule of several phases (a "
                             "mandatory group's items are read ahead of the phase boundary); drop is_mandatory")
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
                              tight=_check_policy(policy, window, cost_slack), window=window, cost_slack=cost_slack)
        self.stats: dict[str, Any] = {}
        self.group_counts: list[int] = []  # stream items of each group, once iterated
        self.phase_log: list[dict[str, Any]] = []

    def _chunk(self, cursor: PhasedBlend, length: int, only: int | None = None) -> tuple[np.ndarray, ...]:
        """(groups, token counts, keys) of the next ``length`` stream items (of group ``only``)."""
        groups, ranks = cursor.take(length)
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

    def _lookahead(self, cursor: PhasedBlend, groups: np.ndarray, counts: np.ndarray, keys: np.ndarray,
                   take: np.ndarray) -> None:
        _check_kernel(self.packer.lookahead(counts, groups, keys, take.view(np.uint8)), "view token counts", counts)
        if cursor.position == self.num_samples:
            for group in np.flatnonzero(take):
                self.packer.end_lookahead(int(group))

    def __iter__(self) -> Iterator[PackChunk]:
        packer = self.packer
        main = PhasedBlend(self.phases, self.table.num_groups)
        mandatory = np.flatnonzero(self.mandatory)
        ahead = {int(g): main.copy() for g in mandatory}  # where each group's lookahead has reached
        self._closed_items = 0  # items in closed packs: bounds how many packs the next items can close
        self._fed_items = 0  # items fed to the packer
        self._fed_tokens = 0  # tokens of the items fed (excluded ones too): bounds the tokens they can close
        self._drained: list[PackChunk] = []
        self._log_phase(main)
        while main.position < self.num_samples:
            start = main.position
            if not main.current.open_ended:
                self._phase_chunk(main)
                yield self._drain(main.position)
                continue
            groups, counts, keys = self._chunk(main, min(self.chunk_size, self.num_samples - start))
            self._count(groups, counts)
            self._fed_items += len(groups)
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
        self.group_counts = main.counts().tolist()
        self.phase_log[-1]["end_position"] = main.position

    def _phase_chunk(self, main: PhasedBlend) -> None:
        """Feed up to a chunk of a limited phase (no mandatory groups), stopping after the item that
        reaches the phase's limit; then the next phase starts there (possibly several, if they are
        reached already)."""
        packer, phase, start = self.packer, main.current, main.position
        before = main.copy()
        groups, counts, keys = self._chunk(main, min(self.chunk_size, self.num_samples - start))
        fed = 0
        while fed < len(groups) and not phase.reached(packer.num_packs, packer.tokens):
            step = self._safe_step(phase, counts[fed:])
            stop = fed + step
            _, needed = packer.feed(counts[fed:stop], groups[fed:stop], keys[fed:stop], start + fed, 0)
            if needed < -1:
                raise ValueError(f"stream item {-2 - needed} has a negative view token count")
            self._fed_items += step
            self._fed_tokens += int(counts[fed:stop].sum())
            self._drained.append(self._drain_packer(start + stop))
            fed = stop
        if fed < len(groups):  # the limit came first: the rest of the chunk belongs to the next phase
            main.__dict__.update(before.__dict__)
            groups, counts = groups[:fed], counts[:fed]
            if fed:
                main.take(fed)
        self._count(groups, counts)
        while main.phase + 1 < len(self.phases) and main.current.reached(packer.num_packs, packer.tokens):
            main.next_phase()
            self._log_phase(main)

    def _safe_step(self, phase: Phase, counts: np.ndarray) -> int:
        """How many of ``counts``' items can be fed at once without possibly passing ``phase``'s limit
        inside the step (at least 1). Every closed pack holds an item, and the tokens closed come from
        items fed: so the packs (tokens) the step closes are at most the items (tokens) pending — fed
        but in no closed pack — plus the step's."""
        packer, step = self.packer, len(counts)
        if phase.until_packs is not None:
            pending = self._fed_items - packer.num_excluded - self._closed_items
            step = min(step, phase.until_packs - packer.num_packs - pending - 1)
        if phase.until_tokens is not None:
            room = phase.until_tokens - self._fed_tokens - 1
            step = min(step, int(np.searchsorted(np.cumsum(counts), room, side="right")))
        return max(step, 1)

    def _count(self, groups: np.ndarray, counts: np.ndarray) -> None:
        """Add items to the current phase's per-group counts (for the mixture report)."""
        log = self.phase_log[-1]
        n = self.table.num_groups
        log["items"] += np.bincount(groups, minlength=n)
        log["tokens"] += np.bincount(groups, weights=counts, minlength=n).astype(np.int64)

    def _log_phase(self, main: PhasedBlend) -> None:
        if self.phase_log:
            self.phase_log[-1]["end_position"] = main.position
        n = self.table.num_groups
        self.phase_log.append({"phase": main.phase, "start_position": main.position,
                               "start_pack": self.packer.num_packs, "start_tokens": self.packer.tokens,
                               "items": np.zeros(n, np.int64), "tokens": np.zeros(n, np.int64)})

    def _drain_packer(self, position: int) -> PackChunk:
        keys, ends, tokens, excluded = self.packer.drain()
        self._closed_items += len(keys)
        samples, views = np.divmod(keys, self.key_stride)
        return PackChunk(samples, views, ends, int(tokens.sum()), len(excluded), position)

    def _drain(self, position: int) -> PackChunk:
        """Every pack closed since the last chunk was yielded, as one chunk."""
        chunks, self._drained = [*self._drained, self._drain_packer(position)], []
        if len(chunks) == 1:
            return chunks[0]
        offsets = np.cumsum([0] + [len(c.samples) for c in chunks[:-1]])
        return PackChunk(np.concatenate([c.samples for c in chunks]), np.concatenate([c.views for c in chunks]),
                         np.concatenate([c.pack_ends + o for c, o in zip(chunks, offsets, strict=True)]),
                         sum(c.tokens for c in chunks), sum(c.excluded for c in chunks), position)


