"""``build_dataset``: plan the units, reuse finished shards, run the rest on an engine, merge, report."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mmidx.ingest.engines import BuildProgress, Engine, LocalEngine
from mmidx.ingest.merge import finish_build
from mmidx.ingest.output import claim_output
from mmidx.ingest.plan import PLAN_NAME, BuildError, BuildOptions, finished_shard, make_plan, plan_record, shard_dir
from mmidx.ingest.remote import build_remote
from mmidx.ingest.report import BuildReport, add_counts, counted, judge, new_counts, report_path
from mmidx.ingest.shard import build_tokenizer, clear_unit
from mmidx.ingest.sharded import is_sharded
from mmidx.ingest.writer import withdraw_dataset
from mmidx.io.files import remove_stale_partials, write_json
from mmidx.io.lock import output_lock
from mmidx.io.storage import is_remote
from mmidx.sources import get_source


@contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """Keep the tokenizers library on one thread, so ``workers`` says how many cores a build uses."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def build_dataset(options: BuildOptions, on_shard: Callable[[Path], None] | None = None) -> BuildReport:
    """Build ``options.output`` from ``options.inputs``; see :mod:`mmidx.ingest` for the guarantees.

    ``on_shard(folder)`` is called in this process as each unit's shard folder is published."""
    started = time.perf_counter()
    output = os.fspath(options.output)
    if is_remote(output):  # built in local scratch, then uploaded (data first, index and metadata last)
        return build_remote(options, build_dataset)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    node = f".node{options.node_rank}of{options.num_nodes}" if options.num_nodes > 1 else ""
    with output_lock(output + node), _single_threaded_tokenizers():
        tokenizer = build_tokenizer(options, fresh=True)
        if get_source(options.source).KIND == "text" and tokenizer.eod is None:
            raise BuildError(f"the tokenizer {options.tokenizer!r} has no eos token to end documents with; "
                             "text datasets need one (set eos_token in its tokenizer_config.json)")
        plan = make_plan(options, tokenizer.identity)
        if not node:
            previous = claim_output(output, plan.key, {"build": plan.config}, force=options.force, command="build")
            if previous is not None:
                if not is_sharded(output):  # a sharded dataset's data is its shards
                    shutil.rmtree(plan.shards, ignore_errors=True)  # the cleanup a killed run did not finish
                remove_stale_partials(report_path(output), exclusive=True)
                judged = judge(previous, options.max_skip_rate)
                return BuildReport({**judged, "already_built": True, "message": "already built: " + judged["message"]})
            if is_sharded(output):  # its shards are about to be rebuilt or reused: it stops opening first
                withdraw_dataset(output)
        os.makedirs(plan.shards, exist_ok=True)
        write_json(Path(plan.shards, PLAN_NAME), plan_record(plan))
        share = plan.share()
        reports = {index: report for index in share
                   if (report := finished_shard(shard_dir(plan.shards, index), plan.unit_key(index))) is not None}
        todo = [index for index in share if index not in reports]
        for index in todo:
            clear_unit(plan, index)
        reused = len(reports)
        progress = BuildProgress(plan, todo, list(reports.values()), on_shard)
        try:
            reports.update(engine_for(options).run(plan, todo, progress))
        finally:
            progress.close()
        if node:
            return _node_report(options, plan.shards, [reports[index] for index in share], reused, started)
        report = finish_build(output, plan_record(plan), [os.fspath(shard_dir(plan.shards, i)) for i in share],
                              [reports[index] for index in share], options.max_skip_rate, reused, started,
                              options.layout)
        if report.data.get("layout") != "sharded":
            shutil.rmtree(plan.shards, ignore_errors=True)
        return report


def _node_report(options: BuildOptions, shards: str, reports: list[dict], reused: int, started: float) -> BuildReport:
    """What one node of a split build did; the verdict on the whole build is ``mmidx merge``'s."""
    totals = new_counts()
    for report in reports:
        add_counts(totals, report)
    totals["seconds"]["wall"] = time.perf_counter() - started
    return BuildReport({**totals, "output": shards, "units": len(reports), "reused_units": reused, "ok": True,
                        "message": f"node {options.node_rank} of {options.num_nodes} built its "
                                   f"{counted(len(reports), 'unit')}; once every node is done: mmidx merge "
                                   f"{shards} (and the other nodes' shard folders, unless they share this one) "
                                   "--output OUTPUT"})


def engine_for(options: BuildOptions) -> Engine:
    """The engine ``options`` ask for."""
    if options.engine == "ray":
        from mmidx.ingest.ray_engine import RayEngine

        return RayEngine(options.ray_address, options.workers)
    return LocalEngine(options.workers)
