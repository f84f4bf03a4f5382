"""Engines run work units and hand back their shard reports; the build does not care how.

Every engine has one method, ``run(plan, todo, progress) -> {unit index: shard report}``, and
raises :class:`BuildError` naming the unit when one cannot be built. ``LocalEngine`` runs the units
in this process or in a pool of worker processes that die with their parent (a ``kill -9`` of the
build leaves no worker behind); ``mmidx.ingest.ray_engine.RayEngine`` runs them as Ray tasks.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from queue import Empty
from typing import Any, Protocol

from mmidx.ingest.plan import BuildError, BuildPlan, shard_dir
from mmidx.ingest.shard import build_unit, tokenizer_for
from mmidx.io.libc import die_with_parent


class BuildProgress:
    """One progress bar for the whole build, however many workers or nodes: rows, samples, skips, shards."""

    def __init__(self, plan: BuildPlan, todo: list[int], reused: list[dict[str, Any]],
                 on_shard: Callable[[Path], None] | None = None):
        from tqdm import tqdm

        self.shards_folder, self.on_shard = plan.shards, on_shard  # on_shard(folder) once a shard is published
        rows = [plan.units[i].rows for i in todo]
        self.shards, self.total_shards = len(reused), len(reused) + len(todo)
        self.samples = sum(report["samples"] for report in reused)
        self.skipped = sum(report["skipped"] for report in reused)
        self.images = self.tokens = self.bytes = 0
        self.skips: Counter[str] = Counter()  # by reason, from finished shards (URL builds: fetch failure classes)
        for report in reused:
            self.skips.update({reason: entry["count"] for reason, entry in report["skips"].items()})
        self.started = time.perf_counter()
        # rows of reused shards count as done from the start, not in the rates
        done = sum(report["rows"] for report in reused)
        self.bar = tqdm(total=None if None in rows else done + sum(rows), initial=done, unit="rows",
                        disable=not plan.options.progress, dynamic_ncols=True, file=sys.stderr,
                        desc=f"{plan.options.source} → {os.path.basename(plan.options.output)}")

    def update(self, rows: int, images: int, tokens: int, size: int = 0) -> None:
        """Rows, images, tokens and image bytes built since the last call (while a unit is being built)."""
        self.images += images
        self.tokens += tokens
        self.bytes += size
        self.bar.update(rows)
        self._postfix()

    def shard_done(self, report: dict[str, Any], counted: bool) -> None:
        """A shard finished; ``counted`` says whether its rows came through :meth:`update` already."""
        self.shards += 1
        self.samples += report["samples"]
        self.skipped += report["skipped"]
        self.skips.update({reason: entry["count"] for reason, entry in report["skips"].items()})
        if not counted:
            self.update(report["rows"], report["images"], report["tokens"])
        self._postfix()
        if self.on_shard is not None:
            self.on_shard(shard_dir(self.shards_folder, report["index"]))

    def _postfix(self) -> None:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        reasons = "".join(f", {reason} {count:,}" for reason, count in self.skips.most_common(3))
        self.bar.set_postfix_str(f"{self.samples:,} samples, {self.skipped:,} skipped{reasons}, shards "
                                 f"{self.shards}/{self.total_shards}, {self.images / elapsed:,.0f} images/s "
                                 f"({self.bytes / elapsed / 1e6:,.1f} MB/s), {self.tokens / elapsed:,.0f} tokens/s",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()


class Engine(Protocol):
    def run(self, plan: BuildPlan, todo: list[int], progress: BuildProgress) -> dict[int, dict[str, Any]]:
        """Build units ``todo`` of ``plan``; return their shard reports by unit index."""


@contextmanager
def failure_names(plan: BuildPlan, index: int) -> Iterator[None]:
    """Turn a failure while building unit ``index`` into a BuildError that names it."""
    try:
        yield
    except BuildError:
        raise
    except Exception as error:
        raise BuildError(f"building {plan.units[index].label} (unit {index}) failed: {error}") from error


_queue: Any = None  # a pool worker's progress queue
_plan: BuildPlan | None = None  # the plan a pool worker builds units of


def _start_worker(parent: int, queue: Any, plan: BuildPlan) -> None:
    global _queue, _plan
    die_with_parent(parent)
    _queue, _plan = queue, plan


def _worker_build_unit(index: int) -> dict[str, Any]:
    assert _plan is not None
    return build_unit(_plan, index, tokenizer_for(_plan), lambda *delta: _queue.put(delta))


class LocalEngine:
    """The units in this process (one worker) or in ``workers`` forked processes on this machine."""

    def __init__(self, workers: int):
        self.workers = workers

    def run(self, plan: BuildPlan, todo: list[int], progress: BuildProgress) -> dict[int, dict[str, Any]]:
        tokenizer = tokenizer_for(plan)  # loaded here once; forked workers inherit it
        workers = min(self.workers, len(todo))
        reports: dict[int, dict[str, Any]] = {}
        if workers <= 1:
            for index in todo:
                with failure_names(plan, index):
                    reports[index] = build_unit(plan, index, tokenizer, progress.update)
                progress.shard_done(reports[index], counted=True)
            return reports
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        queue = context.Queue()
        # The plan goes to the workers as they start, not with each unit: forked workers inherit it unpickled,
        # so a user's function (mmidx.write) may be a lambda or a closure.
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                 initargs=(os.getpid(), queue, plan)) as pool:
            futures: dict[Future, int] = {pool.submit(_worker_build_unit, index): index for index in todo}
            pending = set(futures)
            try:
                while pending:
                    done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                    _drain(queue, progress)
                    for future in done:
                        index = futures[future]
                        with failure_names(plan, index):
                            reports[index] = future.result()
                        progress.shard_done(reports[index], counted=True)
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
        _drain(queue, progress)
        return reports


def _drain(queue: Any, progress: BuildProgress) -> None:
    while True:
        try:
            progress.update(*queue.get_nowait())
        except Empty:
            return
