"""The build plan: the options of one build, its work units, their keys, and where their shards live.

A build cuts its inputs into work units (``source.work_units``); unit ``i`` becomes the shard
``OUTPUT.shards/NNNNN/`` (``shard.*`` files and ``report.json``), and the shards are merged in unit
order. Everything that decides what a unit builds is in the plan's ``config``, so the key of a
unit (``unit_key``) says whether a shard found on disk can be reused. The plan is also written
to ``OUTPUT.shards/plan.json``, so that ``mmidx merge`` can finish a build split over nodes.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mmidx import __version__
from mmidx.errors import MMIDXError
from mmidx.format import BUILD_LAYOUTS, FormatError, output_prefix
from mmidx.io.files import digest, read_json
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources import SourceOptions, WorkUnit, get_source, preflight

ENGINES = ("local", "ray")
PLAN_NAME = "plan.json"


class BuildError(MMIDXError, RuntimeError):
    """A build could not run to its end (not: rows were skipped; those are in the report)."""


@dataclass(frozen=True)
class BuildOptions:
    """One ``mmidx build``: which source reads which inputs, with which tokenizer, into which prefix.

    ``engine`` runs the units: ``"local"`` in ``workers`` processes, ``"ray"`` as tasks of the Ray
    cluster at ``ray_address`` (default: ``RAY_ADDRESS`` or a new local one of ``workers`` CPUs).
    With ``num_nodes`` > 1 this call builds only node ``node_rank``'s share of the units and stops
    before merging; ``mmidx merge`` joins the shard sets of all nodes. A dataset already at ``output``
    that a build of other inputs or options finished is replaced only with ``force``. ``layout`` says how the
    build ends (:func:`mmidx.ingest.sharded.choose_layout`): ``"single"`` merges the shards into one set of files,
    ``"sharded"`` keeps them under a table, in seconds whatever their size; ``"auto"``, single while it is cheap.
    """

    source: str
    inputs: tuple[str, ...]
    tokenizer: str
    output: str
    source_options: SourceOptions = field(default_factory=SourceOptions)
    workers: int = 1
    max_skip_rate: float = 0.01
    progress: bool = True
    engine: str = "local"
    ray_address: str | None = None
    num_nodes: int = 1
    node_rank: int = 0
    force: bool = False
    layout: str = "auto"

    def __post_init__(self) -> None:
        get_source(self.source)
        output_prefix(self.output)  # "out/" would write hidden files (out/.idx...): refused before anything is built
        if not self.inputs:
            raise ValueError("give at least one input")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        if not 0 <= self.max_skip_rate <= 1:
            raise ValueError(f"max_skip_rate is a fraction in [0, 1], not {self.max_skip_rate}")
        if self.layout not in BUILD_LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {', '.join(BUILD_LAYOUTS)}")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if self.ray_address is not None and self.engine != "ray":
            raise ValueError("ray_address needs engine='ray'")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"need 0 <= node_rank < num_nodes, got node_rank {self.node_rank} of {self.num_nodes}")


@dataclass(frozen=True)
class BuildPlan:
    """What every worker needs to build any unit, and what the merge needs to check the shards."""

    options: BuildOptions
    config: dict[str, Any]  # recorded in every shard's and the dataset's metadata
    units: tuple[WorkUnit, ...]
    key: str  # digest of config and units: identifies the whole build
    shards: str  # the folder of the shards

    def unit_key(self, index: int) -> str:
        return digest({"unit": asdict(self.units[index]), "config": self.config})

    def share(self) -> list[int]:
        """The units this call builds: every ``num_nodes``-th, from ``node_rank`` (all with one node)."""
        return list(range(self.options.node_rank, len(self.units), self.options.num_nodes))


def make_plan(options: BuildOptions, tokenizer_identity: dict[str, Any]) -> BuildPlan:
    """Cut the inputs into units and fix the configuration every unit is built with."""
    units = tuple(get_source(options.source).work_units(list(options.inputs), options.source_options))
    preflight.check(options.source, [unit.path for unit in units])  # one line now, not a build that skips it all
    config = {"mmidx": __version__, "source": options.source, "inputs": list(options.inputs),
              "options": options.source_options.recorded(), "tokenizer": tokenizer_identity}
    key = digest({"config": config, "units": [asdict(unit) for unit in units]})
    return BuildPlan(options, config, units, key, os.fspath(options.output) + ".shards")


def plan_record(plan: BuildPlan) -> dict[str, Any]:
    """The plan as ``plan.json`` stores it (what ``mmidx merge`` needs to finish the build)."""
    return {"key": plan.key, "source": plan.options.source, "config": plan.config,
            "units": [asdict(unit) for unit in plan.units],
            "unit_keys": [plan.unit_key(index) for index in range(len(plan.units))]}


# --------------------------------------------------------------------------- files


def meta_sha256(prefix: str | os.PathLike) -> str | None:
    """The metadata checksum of the dataset at ``prefix`` if it opens, else None."""
    try:
        return (MMIDXDataset(prefix).metadata or {}).get("meta_sha256")
    except (FormatError, OSError, ValueError):
        return None


def shard_dir(shards: str | os.PathLike, index: int) -> Path:
    """The folder of unit ``index``'s shard: ``shard.*`` dataset files and ``report.json``."""
    return Path(shards, f"{index:05d}")


def shard_prefix(folder: str | os.PathLike) -> str:
    return os.path.join(folder, "shard")


def finished_shard(folder: str | os.PathLike, key: str) -> dict[str, Any] | None:
    """The report of a shard finished for the unit of ``key``, if ``folder`` holds one that opens."""
    report = read_json(Path(folder, "report.json"))
    if report is None or report.get("key") != key:
        return None
    return report if meta_sha256(shard_prefix(folder)) == report.get("meta_sha256") else None
