"""Mixture schedules in the stream: ``Phase``, ``PhasedBlend``.

Guarantee: a phase blends its groups of positive weight greedily, as :mod:`mmidx.index.blend` does, with
its own error term (item s of the phase goes to the group with the largest ``weight * max(s, 1) - taken in
the phase``), so over any phase every group's share is within one item of its weight. Each group's count
of items taken carries over phase boundaries: the j-th item of group g is always its j-th item of
:mod:`mmidx.index.stream` (sample ``P(g, e)[j % n_g]``), so a group continues its epoch where it stopped,
also after phases without it, and within an epoch no sample repeats or is skipped. One phase whose weights
are all positive is the plain blend, call for call.

Where a phase ends (after ``until_packs`` closed packs or ``until_tokens`` packed tokens, counted from the
run's start) is decided by the packer (:class:`mmidx.index.pack_stream.PackStream`): the next phase starts
with the stream item after the one whose packing reached the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmidx import _blending
from mmidx.index.blend import _normalize


@dataclass(frozen=True)
class Phase:
    """The groups' weights (>= 0, one per group, some positive) until the run has closed ``until_packs``
    packs or packed ``until_tokens`` tokens (None: no such limit; neither: open-ended)."""

    weights: tuple[float, ...]
    until_packs: int | None = None
    until_tokens: int | None = None

    def __post_init__(self) -> None:
        w = np.asarray(self.weights, dtype=np.float64)
        if w.ndim != 1 or not w.size or not np.all(np.isfinite(w)) or np.any(w < 0) or not np.any(w > 0):
            raise ValueError("a phase needs one finite weight >= 0 per group, at least one positive")

    @property
    def open_ended(self) -> bool:
        """Whether the phase has no limit (only the last one of a schedule)."""
        return self.until_packs is None and self.until_tokens is None

    def reached(self, packs: int, tokens: int) -> bool:
        """Whether a run that has closed ``packs`` packs of ``tokens`` tokens is past this phase."""
        return ((self.until_packs is not None and packs >= self.until_packs)
                or (self.until_tokens is not None and tokens >= self.until_tokens))


def taken_over(takeovers: Sequence[tuple[int, Sequence[Phase]]]) -> list[Phase]:
    """The one schedule of a run whose schedules took over at packs ``k_0 = 0 < k_1 < ...`` (a mid-run edit
    is a takeover at the packs consumed): each schedule's phases, every phase of all but the last schedule
    ending at the latest at the pack where the next took over (phases whose limit has passed by then are
    skipped as the stream reaches them). Packs before ``k_i`` are those of the schedules before it alone."""
    phases = []
    for number, (_, schedule) in enumerate(takeovers):
        end = takeovers[number + 1][0] if number + 1 < len(takeovers) else None
        for phase in schedule:
            if end is not None:
                phase = Phase(phase.weights, end if phase.until_packs is None else min(phase.until_packs, end),
                              phase.until_tokens)
            phases.append(phase)
    return phases


class PhasedBlend:
    """A place in the phased stream: the phase, the items taken in it per group (the phase's blend state)
    and each group's items taken before it. ``take(n)`` continues the current phase for n items."""

    def __init__(self, phases: list[Phase], num_groups: int):
        if not phases or any(len(p.weights) != num_groups for p in phases):
            raise ValueError("every phase needs one weight per group")
        if any(p.open_ended for p in phases[:-1]) or not phases[-1].open_ended:
            raise ValueError("every phase but the last needs a limit; the last is open-ended")
        self.phases = phases
        self.phase = 0
        self.position = 0  # stream items so far, all phases
        self.start = 0  # stream position where the current phase began
        self.before = np.zeros(num_groups, dtype=np.int64)  # each group's items before the current phase
        self._enter()

    def _enter(self) -> None:
        weights = np.asarray(self.phases[self.phase].weights, dtype=np.float64)
        self.active = np.flatnonzero(weights > 0).astype(np.int32)
        self.weights = _normalize(weights[self.active])
        self.taken = np.zeros(len(self.active))  # the phase's blend counts (doubles, as the kernel keeps them)

    @property
    def current(self) -> Phase:
        """The phase the next item belongs to."""
        return self.phases[self.phase]

    def counts(self) -> np.ndarray:
        """Items taken of each group so far (int64, one per group)."""
        counts = self.before.copy()
        counts[self.active] += self.taken.astype(np.int64)
        return counts

    def copy(self) -> PhasedBlend:
        """An independent cursor at the same place (a read-ahead, or a place to come back to)."""
        other = object.__new__(PhasedBlend)
        other.__dict__.update(self.__dict__)
        other.before, other.taken = self.before.copy(), self.taken.copy()
        return other

    def take(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(groups int32, ranks int64) of the next ``length`` items, all in the current phase: rank = how
        many items of its group came before it in the whole stream."""
        local = np.empty(length, dtype=np.int32)
        ranks = np.empty(length, dtype=np.int64)
        _blending.build_blending_indices(self.weights, local, ranks, self.taken, self.position - self.start)
        self.position += length
        if len(self.active) == len(self.before) and not self.before.any():
            return local, ranks  # the first phase over every group: the plain blend
        groups = self.active[local]
        ranks += self.before[groups]
        return groups, ranks

    def next_phase(self) -> None:
        """End the current phase here; the next one starts with the next item."""
        if self.phase + 1 >= len(self.phases):
            raise ValueError("the last phase is open-ended")
        self.before = self.counts()
        self.phase += 1
        self.start = self.position
        self._enter()
