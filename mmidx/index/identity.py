"""Which stream a loader's resume state belongs to: ``StreamIdentity``, the parts of a pack index's cache key.

A loader's state counts the packs consumed; the packs are a pure function of the pack index's description
(:func:`mmidx.index.pack_index.build_pack_index`: the config, its seed, the datasets, the stream length, the
mixture history). The state carries that description in parts, each hashed by the cache's own key
(:func:`mmidx.index.cache.description_key`), so that a loader over another stream refuses it saying which
part differs, instead of continuing at pack n of a stream whose first n packs were never trained.

Only what made the packs consumed counts. The mixture part is the weights and schedules in force before
the pack where the state's global batch ends: a mixture edit recorded in the run's history takes over
there (:func:`mmidx.index.history.takeover_pack`) and continues the same stream. The config part leaves
out what a resume may change without touching a pack (:func:`mmidx.index.history.mixture_free`: weights,
schedule, dropout, duplicate policy) and where the datasets lie (their contents are the datasets part).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mmidx.index.cache import description_key
from mmidx.index.history import MixtureHistory, mixture_free

# What each part is, as a refusal names it (the seed and the lengths with their values, hashes without).
PART_NAMES = {"version": "the pack index version (this mmidx packs otherwise)", "seed": "the seed",
              "num_samples": "the stream length (num_samples)", "datasets": "the datasets' contents (checksums)",
              "config": "the config (groups, transforms, packing budgets or geometry)",
              "mixture": "the mixture (weights or schedule) of the packs consumed"}
SHOWN = ("seed", "num_samples", "version")  # parts a refusal prints, old → new


@dataclass(frozen=True)
class StreamIdentity:
    """The identity of a pack index's stream: ``parts(end)`` for a state whose packs before ``end`` were
    dealt to the ranks, ``differences(saved, end)`` against the parts a state carries."""

    history: MixtureHistory
    num_samples: int
    checksums: tuple[tuple[str, ...], ...]  # per group of the history's config, per dataset
    version: int
    _parts: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:  # one set of parts per takeover: a state's are looked up, not hashed
        for count in range(1, len(self.history.takeovers) + 1):
            before = self.history.takeovers[:count]
            config = before[-1][1]
            described = mixture_free(config).describe()
            del described["seed"]
            for group in described["groups"]:
                del group["datasets"]  # where they lie; what they hold is the datasets part
            self._parts.append({
                "version": self.version, "seed": config.seed, "num_samples": self.num_samples,
                "datasets": description_key({"checksums": self.checksums[:len(config.groups)]}),
                "config": description_key(described),
                "mixture": description_key({"takeovers": [{"from_pack": k, "phases": c.phase_weights()}
                                                          for k, c in before]})})

    def parts(self, end: int) -> dict[str, Any]:
        """Plain data (ints and short hashes) naming the stream whose packs before ``end`` were dealt."""
        count = max(1, sum(k < end for k, _ in self.history.takeovers))
        return dict(self._parts[count - 1])

    def differences(self, saved: Mapping[str, Any], end: int) -> list[str]:
        """What differs between ``saved`` (a state's parts) and this stream's before ``end``, each named."""
        ours = self.parts(end)
        named = []
        for part, name in PART_NAMES.items():
            if saved.get(part) != ours[part]:
                shown = f" ({saved.get(part)!r} → {ours[part]!r})" if part in SHOWN else ""
                named.append(f"{name}{shown}")
        return named
