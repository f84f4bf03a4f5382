"""The mixture history of a run: which data config was in force from which pack — ``MixtureHistory``.

A resumed run whose data.yaml was edited (new weights, a new schedule) is the old config up to the pack it
resumed at and the new one after it: a new phase at the checkpoint. A checkpoint saved inside a global batch
resumes the old config to the batch's end, where the new one takes over (:func:`takeover_pack`). The history
records every config with the pack where it took over (fully resolved, so editing the YAML again cannot change
a recorded one), and the pack index of a history is the one schedule that strings them together
(:func:`MixtureHistory.phases`). Packs already consumed can never change: an edit of anything but the groups'
weights and the schedule — datasets of a group, transforms, packing budgets, geometry, seed — is refused with
one line saying what to do.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mmidx.config import DataConfig
from mmidx.errors import MMIDXError
from mmidx.index.schedule import Phase, taken_over

HISTORY_FILE = "mixture_history.json"


class HistoryError(MMIDXError, ValueError):
    """An edit that would change packs already consumed, or a history that cannot be read."""


@dataclass(frozen=True)
class MixtureHistory:
    """The configs of one run, each with the pack from which it is in force (the first from pack 0)."""

    takeovers: tuple[tuple[int, DataConfig], ...]

    def __post_init__(self) -> None:
        packs = [k for k, _ in self.takeovers]
        if not packs or packs[0] != 0 or any(b <= a for a, b in itertools.pairwise(packs)):
            raise HistoryError(f"a mixture history starts at pack 0 and its takeovers grow, got packs {packs}")
        for (_, old), (k, new) in itertools.pairwise(self.takeovers):  # a history file edited by hand, too
            check_edit(old, new, k)

    @classmethod
    def of(cls, config: DataConfig) -> MixtureHistory:
        """A run that has used ``config`` from its start."""
        return cls(((0, config),))

    @property
    def config(self) -> DataConfig:
        """The config in force now (the last one)."""
        return self.takeovers[-1][1]

    def take_over(self, config: DataConfig, at_pack: int) -> MixtureHistory:
        """This history resumed at pack ``at_pack`` (packs consumed) with ``config``: unchanged when it is the
        config in force there; takeovers recorded at or after ``at_pack`` (a run rolled back to an earlier
        checkpoint) are dropped. Raises ``HistoryError`` for an edit that changes consumed packs."""
        if at_pack < 0:
            raise HistoryError(f"packs consumed must be >= 0, got {at_pack}")
        if at_pack == 0:  # nothing consumed: the run starts afresh with ``config``
            return MixtureHistory.of(config)
        kept = tuple((k, c) for k, c in self.takeovers if k < at_pack)
        in_force = kept[-1][1]
        if in_force == config:
            return MixtureHistory(kept)
        return MixtureHistory((*kept, (at_pack, config)))  # checks the edit

    def phases(self) -> list[Phase]:
        """The one schedule of the run (:func:`mmidx.index.schedule.taken_over`): each config's phases, the
        phases of each but the last config ending at the latest at the pack where the next took over. A
        group added by a later config has weight 0 in the phases before it took over."""
        width = len(self.config.groups)
        return taken_over([(k, [Phase((*w, *[0.0] * (width - len(w))), packs, tokens)
                                for w, packs, tokens in config.phase_weights()])
                           for k, config in self.takeovers])

    def describe(self) -> list[dict[str, Any]]:
        """Plain data for the cache key: each takeover's pack and config description."""
        return [{"from_pack": k, "config": c.describe()} for k, c in self.takeovers]

    def save(self, path: str | os.PathLike) -> None:
        """Write the history as JSON (atomically: a temporary file renamed over it)."""
        path = Path(path)
        text = json.dumps({"takeovers": [{"from_pack": k, "config": c.to_dict()} for k, c in self.takeovers]},
                          indent=1)
        temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        temporary.write_text(text)
        temporary.rename(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> MixtureHistory:
        """Read a history written by ``save``."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(tuple((int(t["from_pack"]), DataConfig.from_dict(t["config"])) for t in data["takeovers"]))
        except HistoryError as error:  # a history whose later config changes packs an earlier one made
            raise HistoryError(f"{path}: {error}") from None
        except (OSError, KeyError, TypeError, ValueError) as error:
            raise HistoryError(f"{path}: not a mixture history ({error}); it is written by the loader "
                               "(trainer_loader(history=...)) or MixtureHistory.save") from None


def mixture_free(config: DataConfig, num_groups: int | None = None) -> DataConfig:
    """``config`` (its first ``num_groups`` groups) without what a resume may change: the weights, the
    schedule, dropout, duplicate policy (what is left made the packs consumed, with the mixture)."""
    groups = tuple(replace(g, weight=1.0) for g in config.groups[:num_groups])
    return replace(config, groups=groups, schedule=(), dropout=type(config.dropout)(), allow_duplicates=False)


def check_edit(old: DataConfig, new: DataConfig, at_pack: int) -> None:
    """Refuse (``HistoryError``, one line) a ``new`` config that would change packs consumed under ``old``.
    New groups after the old ones are an edit like weights: a group's samples, numbers and permutations
    do not depend on the groups after it, and it had weight 0 before it was added."""
    before, after = mixture_free(old), mixture_free(new, len(old.groups))
    names = [g.name for g in old.groups], [g.name for g in new.groups]
    if before == after and names[1][:len(names[0])] == names[0]:
        return
    consumed = f"the {at_pack:,} packs already consumed"
    if names[1][:len(names[0])] != names[0]:
        what = f"the groups ({names[0]} → {names[1]})"
        fix = ("keep every group, in order, and add new ones after them (give a group weight 0 in a schedule "
               "phase to drop it)")
    else:
        changed = [f"group {a.name!r}" for a, b in zip(before.groups, after.groups, strict=True) if a != b]
        changed += [key for key in ("packing", "geometry", "seed") if getattr(before, key) != getattr(after, key)]
        what = ", ".join(changed)
        fix = "change only weights and the schedule at a resume, or start a new run with a fresh cache"
    raise HistoryError(f"the edited config changes {what}, which made {consumed}; {fix}")


def takeover_pack(resumed_at: int | Mapping[str, Any]) -> int:
    """The pack where a config edited at a resume takes over: ``resumed_at`` itself for a pack number (the
    first ``resumed_at`` packs consumed, as at an optimizer step); for a loader's state (``state_dict()``),
    the end of the global batch it was saved in. Inside a global batch each rank has used the first packs of
    its own share, and the rest of the batch was dealt under the config before, so that config finishes the
    batch: every pack trained is then the one the history's pack index holds."""
    if not isinstance(resumed_at, Mapping):
        return _count(resumed_at, "packs consumed")
    consumed = _count(resumed_at.get("packs_consumed"), "the loader state's packs_consumed")
    batch = resumed_at.get("global_batch_size", 1)  # older states lack it: their count as it is
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise HistoryError(f"the loader state's global_batch_size must be a positive integer, got {batch!r}")
    return -(-consumed // batch) * batch


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HistoryError(f"{what} must be an integer >= 0, got {value!r}")
    return value


def resumed_history(path: str | os.PathLike, config: DataConfig, resumed_at: int | Mapping[str, Any], *,
                    write: bool = True) -> MixtureHistory:
    """The history at ``path`` resumed with ``config``, which takes over at :func:`takeover_pack` of
    ``resumed_at`` (the loader's state, or a pack number at an optimizer step) if it changed the mixture;
    written back when ``write`` (one rank writes; every rank computes the same). A run starts its history
    at pack 0; a resume without one is refused, as its first config is unknown."""
    path = Path(path)
    at_pack = takeover_pack(resumed_at)
    if path.exists():
        history = MixtureHistory.load(path)
    elif at_pack == 0:
        history = MixtureHistory.of(config)
    else:
        raise HistoryError(f"no mixture history at {path} for a run resumed at pack {at_pack:,}: pass the "
                           "history the run started with, or save MixtureHistory.of(<the config it ran>) there")
    history = history.take_over(config, at_pack)
    if write:
        history.save(path)
    return history
