"""A mixture schedule of a data.yaml: its phases (``PhaseConfig``), parsed and checked.

A ``schedule`` replaces the groups' ``weight`` keys: each phase weighs the groups anew and ends once the run has
closed ``packs`` packs or packed ``tokens`` tokens; the last phase is open-ended (:mod:`mmidx.index.schedule`
runs it).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PhaseConfig:
    """One phase of a mixture schedule: the groups' weights until the run has closed ``until_packs`` packs
    or packed ``until_tokens`` tokens (both counted from the run's start; neither: open-ended, the last)."""

    weights: tuple[tuple[str, float], ...]
    until_packs: int | None = None
    until_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", tuple((str(k), float(v)) for k, v in self.weights))
        for name, value in self.weights:
            if not (value >= 0 and value < float("inf")):
                raise ValueError(f"schedule: weight of {name!r} must be finite and >= 0, got {value}")
        if not any(value > 0 for _, value in self.weights):
            raise ValueError("schedule: a phase needs at least one group of positive weight")
        for key in ("until_packs", "until_tokens"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
                raise ValueError(f"schedule: until {key[6:]} must be a positive integer, got {value!r}")

    def weight_of(self, group: str) -> float:
        """This phase's weight of ``group`` (0 when absent)."""
        return dict(self.weights).get(group, 0.0)


def parse_schedule(entries: Any) -> tuple[PhaseConfig, ...]:
    """The phases of a ``schedule:`` list (see the module docstring), each entry checked for its keys."""
    if entries is None:
        return ()
    if not isinstance(entries, list) or not entries:
        raise ValueError("schedule must be a non-empty list of phases, each {until: {packs: N}, weights: {...}}")
    phases = []
    for number, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or set(entry) - {"until", "weights"} or "weights" not in entry:
            raise ValueError(f"schedule phase {number}: needs weights: {{group: weight}} and, except the last, "
                             "until: {packs: N} or {tokens: N}; no other keys")
        until = entry.get("until")
        if until is not None and (not isinstance(until, Mapping) or len(until) != 1
                                  or next(iter(until)) not in ("packs", "tokens")):
            raise ValueError(f"schedule phase {number}: until must be {{packs: N}} or {{tokens: N}}, got {until!r}")
        if not isinstance(entry["weights"], Mapping):
            raise ValueError(f"schedule phase {number}: weights must map group names to weights")
        until = dict(until or {})
        try:
            phases.append(PhaseConfig(tuple(entry["weights"].items()), until_packs=until.get("packs"),
                                      until_tokens=until.get("tokens")))
        except (TypeError, ValueError) as error:
            raise ValueError(f"schedule phase {number}: {error}".replace("schedule: ", "")) from None
    return tuple(phases)


def check_schedule(schedule: tuple[PhaseConfig, ...], names: list[str]) -> None:
    """Refuse unknown groups, an open-ended phase before the last, a limited last phase, and limits of one
    kind that do not grow."""
    for number, phase in enumerate(schedule):
        unknown = sorted(set(dict(phase.weights)) - set(names))
        if unknown:
            raise ValueError(f"schedule phase {number}: unknown groups {unknown}; the groups are {names}")
        last = number == len(schedule) - 1
        limited = phase.until_packs is not None or phase.until_tokens is not None
        if last and limited:
            raise ValueError(f"schedule phase {number}: the last phase is open-ended; drop its until")
        if not last and not limited:
            raise ValueError(f"schedule phase {number}: every phase but the last needs until: {{packs: N}} or "
                             "{tokens: N}")
    for kind in ("until_packs", "until_tokens"):
        limits = [getattr(p, kind) for p in schedule if getattr(p, kind) is not None]
        if any(b <= a for a, b in itertools.pairwise(limits)):
            raise ValueError(f"schedule: until {kind[6:]} must grow from phase to phase (counted from the run's "
                             f"start), got {limits}")
