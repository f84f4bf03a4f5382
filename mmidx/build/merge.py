"""Merge: shards into the dataset of their build, and ``mmidx merge`` of shard sets or whole datasets.

A build ends in :func:`finish_build`: the shards are merged in unit order into ``OUTPUT`` and the
build report is written last. ``mmidx merge OUTPUT INPUT...`` finishes a build that was split over
nodes (``--num-nodes``): its inputs are the shard folders (``OUTPUT.shards``) of the nodes, named in
any order; every unit of the plan must be found in one of them, and the result is byte-identical to
a build on one machine. Its inputs may instead be whole datasets (same kind, tokenizer and format
version, checked), which are concatenated in the order given. Time and memory are proportional to
the index arrays; the output is written crash-safely (``mmidx.builder``) under a lock.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from mmidx import format as fmt
from mmidx.build.lock import output_lock
from mmidx.build.plan import (
    PLAN_NAME,
    BuildError,
    finished_shard,
    meta_sha256,
    read_json,
    shard_dir,
    shard_prefix,
    write_json,
)
from mmidx.build.report import BuildReport, add_counts, judge, new_counts, report_path
from mmidx.builder import merge_datasets
from mmidx.fetch.ledger import merge_ledgers
from mmidx.sources import SKIP_REASONS, WARNING_REASONS, default_max_skip_rate


def _remove_dataset(prefix: str | os.PathLike) -> None:
    """Make the dataset at ``prefix`` stop opening (index first), then delete its other files."""
    for role in ("idx", "meta", "bin", "images", "plan"):
        fmt.file_path(os.fspath(prefix), role).unlink(missing_ok=True)


def finish_build(output: str, record: dict[str, Any], shards: list[str], reports: list[dict[str, Any]],
                 max_skip_rate: float, reused: int, started: float) -> BuildReport:
    """Merge the shard folders ``shards`` (in unit order) into ``output`` and write its build report.

    A build without a single sample writes no dataset (and removes an old one at ``output``): an
    empty dataset that opens would hide that the inputs were not what the options expected.
    """
    merge_started = time.perf_counter()
    totals = new_counts()
    for report in reports:
        add_counts(totals, report)
    report_path(output).unlink(missing_ok=True)
    if totals["samples"]:
        merge_datasets([shard_prefix(folder) for folder in shards], output, build_config=record["config"])
    else:
        _remove_dataset(output)
    merge_ledgers(shards, output)
    totals["seconds"].update(merge=time.perf_counter() - merge_started, wall=time.perf_counter() - started)
    data = judge({"output": os.fspath(output), "source": record["source"], "key": record["key"],
                  "meta_sha256": meta_sha256(output), "units": len(shards), "reused_units": reused,
                  "reasons": {reason: SKIP_REASONS[reason] for reason in totals["skips"]},
                  "warning_reasons": {reason: WARNING_REASONS[reason] for reason in totals["warnings"]}, **totals},
                 max_skip_rate)
    write_json(report_path(output), data)
    return BuildReport(data)


def merge_into(output: str | os.PathLike, inputs: list[str | os.PathLike], *,
               max_skip_rate: float | None = None) -> BuildReport:
    """``mmidx merge``: join shard folders of one build (any order) or whole datasets (in order) into ``output``.

    ``max_skip_rate`` None: the default of the build's source (:func:`mmidx.sources.default_max_skip_rate`)."""
    started = time.perf_counter()
    output = os.fspath(output)
    if not inputs:
        raise BuildError("give at least one input")
    plans = [read_json(Path(item, PLAN_NAME)) if Path(item).is_dir() else None for item in inputs]
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with output_lock(output, "merge"):
        if all(plan is not None for plan in plans):
            return _merge_shard_sets(output, [os.fspath(item) for item in inputs], plans, max_skip_rate, started)
        if any(plan is not None for plan in plans):
            raise BuildError("give either shard folders of one build (each with a plan.json) or datasets, not both")
        return _merge_datasets(output, [os.fspath(item) for item in inputs], started)


def _merge_shard_sets(output: str, inputs: list[str], plans: list[dict[str, Any]], max_skip_rate: float | None,
                      started: float) -> BuildReport:
    first = plans[0]
    if max_skip_rate is None:
        max_skip_rate = default_max_skip_rate(first["source"])
    for folder, plan in zip(inputs[1:], plans[1:], strict=True):
        for what, value in (("kind of source", "source"), ("tokenizer", "tokenizer"), ("mmidx version", "mmidx")):
            mine = plan["config"].get(value) if value != "source" else plan["source"]
            theirs = first["config"].get(value) if value != "source" else first["source"]
            if mine != theirs:
                raise BuildError(f"cannot merge {folder} with {inputs[0]}: they were built with a different "
                                 f"{what} ({mine!r} vs {theirs!r})")
        if plan["key"] != first["key"]:
            raise BuildError(f"cannot merge {folder} with {inputs[0]}: they belong to different builds (other "
                             "inputs or options); every node must run the same mmidx build command")
    folders, reports, missing = [], [], []
    for index, key in enumerate(first["unit_keys"]):
        found = next(((shard_dir(folder, index), report) for folder in inputs
                      if (report := finished_shard(shard_dir(folder, index), key)) is not None), None)
        if found is None:
            missing.append(index)
        else:
            folders.append(os.fspath(found[0]))
            reports.append(found[1])
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise BuildError(f"{len(missing)} of {len(first['unit_keys'])} units have no finished shard in the inputs "
                         f"(units {shown}); run the build of the node(s) that own them again, then merge")
    return finish_build(output, first, folders, reports, max_skip_rate, len(folders), started)


def _merge_datasets(output: str, inputs: list[str], started: float) -> BuildReport:
    from mmidx.dataset import MMIDXDataset

    for prefix in inputs:
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(prefix + ".idx", output + ".idx"):
                raise BuildError(f"{output} is also an input; write the merge to a new prefix")
    merge_datasets(inputs, output)
    dataset = MMIDXDataset(output)
    counts = (dataset.metadata or {}).get("counts", {})
    totals = {**new_counts(), "samples": len(dataset), "rows": len(dataset), "tokens": counts.get("tokens", 0),
              "views": counts.get("views", len(dataset)), "images": counts.get("images", 0)}
    totals["seconds"]["wall"] = time.perf_counter() - started
    return BuildReport({**totals, "output": output, "units": len(inputs), "reused_units": len(inputs), "ok": True,
                        "message": f"merged {len(inputs)} datasets"})
