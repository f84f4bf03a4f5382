"""Streamed packing — ``PackStream``: the packs of :func:`~mmidx.index.stream.multimodal_stream` →
:func:`~mmidx.index.stream.stream_views` → :func:`~mmidx.index.packer.pack_samples`, item for item (as sample
numbers and views), computed a chunk at a time.

Guarantee: the blend's counts, the packer's buffer, open pack and mandatory queues carry over chunk
boundaries, so memory is the chunk and the view tables, whatever the stream's length. With a schedule
(:mod:`mmidx.index.schedule`) a phase ends at the stream item whose packing closed its ``until_packs``-th
pack (or reached its ``until_tokens``): the packer stops the feed right after that item, so the boundary —
and every pack — is the same whatever the chunk size.

Mandatory groups in a schedule. A pack starts with the earliest unplaced item of each mandatory group,
which may lie ahead of the stream; whether the stream holds the group's next item depends on the phases
to come, which depend on the packs. The rule: a pack opened while the stream is in phase p takes the
group's next item if the stream *with phase p continued to its end* holds it (else none, as at the end of
a stream). The group's j-th item is sample ``P(g, e)[j mod n]`` whichever phase delivers it, so the
queue is the same in any phase; only where it ends changes. When a new phase starts, each mandatory
group's queued items that no pack took are dropped and its lookahead continues from the first of them
under the new phase (none where the group's weight is 0). Items packs took ahead stay delivered, once: when
the stream reaches them it skips them, and if the new phase holds fewer of the group's items they are
delivered beyond the stream — the packs then hold more items than ``num_samples`` (at most
``num_samples`` per mandatory group; ``group_counts`` counts them). With the ``bagel`` policy the pack
open when a phase's limit is reached was started, mandatory items included, in that phase. One phase is
the plain rule exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmidx import _stream
from mmidx.index.blend import checked_weights
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
    chunk's worth of them. ``phases`` (optional) replaces ``weights`` by a schedule (with mandatory
    groups: the module's rule); ``phase_log`` holds, once iterated, each phase's start (stream position and
    packs closed) and the stream's items and tokens per group in it; ``group_counts`` the items of each
    group delivered in all.
    """

    def __init__(self, table: ViewTable, weights: np.ndarray | list[float], num_samples: int, seed: int, *,
                 mandatory: np.ndarray | list[bool], max_num_tokens: int, expected_num_tokens: int,
                 max_num_tokens_per_sample: int, prefer_buffer_before: int, max_buffer_size: int,
                 chunk_size: int = 1 << 20, phases: list[Phase] | None = None, policy: str = "bagel",
                 window: int = 128, cost_slack: float | None = DEFAULT_COST_SLACK):
        self.table = table
        # the weights as given: the blend normalises each phase's once (normalised here too, w / sum(w) twice is
        # not w / sum(w) to the last bit, and the same weights blended alone and as a schedule's phase differed)
        self.phases = [Phase(tuple(checked_weights(weights).tolist()))] if phases is None else list(phases)
        if len(self.phases[0].weights) != table.num_groups or len(mandatory) != table.num_groups:
            raise ValueError("weights, mandatory and the view table need one entry per group")
        if num_samples < 0 or chunk_size < 1:
            raise ValueError(f"num_samples must be >= 0 and chunk_size >= 1, got {num_samples}, {chunk_size}")
        self.num_samples = int(num_samples)
        self.chunk_size = int(chunk_size)
        self.group_sizes = np.diff(table.group_base)
        self.group_keys = _group_keys(seed, table.num_groups)
        self.key_stride = table.max_views
        self._offsets = table.kernel_offsets
        self.mandatory = np.asarray(mandatory, dtype=bool)
        _check_budgets(max_num_tokens, expected_num_tokens, max_num_tokens_per_sample, prefer_buffer_before,
                       max_buffer_size)
        self.budgets = (max_num_tokens, expected_num_tokens)
        self.packer = _packer(self.mandatory, max_num_tokens, expected_num_tokens, max_num_tokens_per_sample,
                              prefer_buffer_before, max_buffer_size, self.num_samples,
                              tight=_check_policy(policy, window, cost_slack), window=window, cost_slack=cost_slack)
        self.stats: dict[str, Any] = {}
        self.group_counts: list[int] = []  # items of each group delivered, once iterated
        self.phase_log: list[dict[str, Any]] = []

    def _chunk(self, cursor: PhasedBlend, length: int, only: int | None = None) -> tuple[np.ndarray, ...]:
        """(groups, token counts, keys) of the next ``length`` stream items (of group ``only``, from the
        rank its lookahead continues from)."""
        groups, ranks = cursor.take(length)
        if only is not None:
            chosen = (groups == only) & (ranks >= self._skip[only])
            groups, ranks = groups[chosen], ranks[chosen]
        n = len(groups)
        samples, epochs = np.empty(n, np.int64), np.empty(n, np.int64)
        _stream.stream_samples(groups, ranks, self.group_sizes, self.group_keys, samples, epochs)
        views, counts, keys = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int64)
        t = self.table
        _stream.item_views(groups, samples, epochs, t.group_base, self._offsets, t.view_tokens, self.key_stride,
                           views, counts, keys)
        return groups, counts, keys

    def _lookahead(self, cursor: PhasedBlend, groups: np.ndarray, counts: np.ndarray, keys: np.ndarray,
                   take: np.ndarray) -> None:
        """Queue the items of the groups flagged in ``take`` (``cursor``: where these items end)."""
        _check_kernel(self.packer.lookahead(counts, groups, keys, take.view(np.uint8)), "view token counts", counts)
        given = np.bincount(groups, minlength=len(take))
        for group in np.flatnonzero(take):
            self._given[group] += int(given[group])
            if cursor.position == self.num_samples:
                self.packer.end_lookahead(int(group))
                self._over.add(int(group))

    def _read_ahead(self, group: int) -> None:
        """Queue group ``group``'s items of the next chunk beyond its lookahead's cursor."""
        cursor = self._ahead[group]
        only = self._chunk(cursor, min(self.chunk_size, self.num_samples - cursor.position), group)
        self._lookahead(cursor, *only, take=np.arange(self.table.num_groups) == group)

    def _look_over(self, main: PhasedBlend, start: int, groups: np.ndarray, counts: np.ndarray,
                   keys: np.ndarray) -> None:
        """Before the chunk at ``start`` (``main`` now past it) is fed: queue its items of the mandatory groups
        whose lookahead has not run ahead of it (lookahead always covers what the stream reaches)."""
        take = np.zeros(self.table.num_groups, dtype=bool)
        for group, cursor in self._ahead.items():
            if group in self._over or cursor.position != start:
                continue
            if cursor.counts()[group] >= self._skip[group]:
                take[group] = True
                self._ahead[group] = main.copy()
            else:  # packs took items of the chunk ahead already: read it again, from the rank to continue from
                self._read_ahead(group)
        if take.any():
            self._lookahead(main, groups, counts, keys, take)

    def _restart_lookahead(self, main: PhasedBlend) -> None:
        """A new phase began at ``main``: each mandatory group's queued items no pack took are dropped, and
        its lookahead continues from the first of them in the new phase (none if its weight there is 0)."""
        for group in self._ahead:
            self._skip[group] = self._given[group] = self.packer.restart_lookahead(group)
            self._over.discard(group)
            self._ahead[group] = main.copy()
        self._end_absent(main)

    def _end_absent(self, main: PhasedBlend) -> None:
        """End the lookahead of the mandatory groups of weight 0 in ``main``'s phase (it holds none of their
        items: reading ahead to the stream's end would find none)."""
        for group in self._ahead:
            if main.current.weights[group] == 0:
                self.packer.end_lookahead(group)
                self._over.add(group)

    def __iter__(self) -> Iterator[PackChunk]:
        packer = self.packer
        main = PhasedBlend(self.phases, self.table.num_groups)
        self._ahead = {int(g): main.copy() for g in np.flatnonzero(self.mandatory)}  # where each lookahead is
        self._skip = dict.fromkeys(self._ahead, 0)  # per mandatory group: the rank its lookahead continues from
        self._given = dict.fromkeys(self._ahead, 0)  # per mandatory group: items given to lookahead
        self._over: set[int] = set()  # mandatory groups whose lookahead holds every item of the phase
        self._log_phase(main)
        self._end_absent(main)
        while main.position < self.num_samples:
            start, phase, before = main.position, main.current, main.copy()
            groups, counts, keys = self._chunk(main, min(self.chunk_size, self.num_samples - start))
            self._look_over(main, start, groups, counts, keys)
            fed = self._feed(phase, groups, counts, keys, start)
            if fed < len(groups):  # the phase's limit came first: the rest of the chunk belongs to the next one
                main.__dict__.update(before.__dict__)
                groups, counts = groups[:fed], counts[:fed]
                main.take(fed)
            self._count(groups, counts)
            number = main.phase
            while main.phase + 1 < len(self.phases) and main.current.reached(packer.num_packs, packer.tokens):
                main.next_phase()  # (several, where limits passed already)
                self._log_phase(main)
            if main.phase != number:
                self._restart_lookahead(main)
            yield self._drain(main.position)
        for group in self._ahead:  # an empty stream never reached the lookahead
            packer.end_lookahead(group)
        packer.finish()
        yield self._drain(main.position)
        self.stats = packing_stats(packer, *self.budgets)
        counts = main.counts()
        for group, given in self._given.items():  # items packs took ahead of a phase that then ended
            counts[group] = max(counts[group], given)
        self.group_counts = counts.tolist()
        self.phase_log[-1]["end_position"] = main.position

    def _feed(self, phase: Phase, groups: np.ndarray, counts: np.ndarray, keys: np.ndarray, start: int) -> int:
        """Pack a chunk, giving mandatory groups lookahead as the packer asks for it; returns the items fed:
        fewer than the chunk's when ``phase``'s limit was reached first (by the packing of the last of them)."""
        limits = (-1 if phase.until_packs is None else phase.until_packs,
                  -1 if phase.until_tokens is None else phase.until_tokens)
        begin = 0
        while True:
            begin, needed = self.packer.feed(counts, groups, keys, start, begin, *limits)
            if needed == -1:
                return begin
            if needed < -1:
                raise ValueError(f"stream item {-2 - needed} has a negative view token count")
            self._read_ahead(needed)

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

    def _drain(self, position: int) -> PackChunk:
        """Every pack closed since the last chunk was yielded, as one chunk."""
        keys, ends, tokens, excluded = self.packer.drain()
        samples, views = np.divmod(keys, self.key_stride)
        return PackChunk(samples, views, ends, int(tokens.sum()), len(excluded), position)
