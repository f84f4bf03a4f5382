"""The Ray engine: each work unit is one Ray task on one CPU of a cluster.

Ray is optional (``pip install "mmidx[ray]"``) and imported only here. The plan is put into the
object store once; each task builds its unit with :func:`mmidx.ingest.shard.build_unit`, whose
attempt folders and publishing rename make retried or duplicated tasks harmless. A task is retried
(at most ``MAX_RETRIES`` times) when its worker process dies and when it fails with a transient
``OSError`` (I/O error, timeout, stale network file handle...); a bad row is never a failure, it is
a counted skip. The driver keeps at most ``WINDOW_PER_CPU`` tasks per cluster CPU in flight.
"""

from __future__ import annotations

import os
from typing import Any

from mmidx.ingest.engines import BuildProgress, failure_names
from mmidx.ingest.plan import BuildPlan
from mmidx.ingest.shard import build_unit, tokenizer_for
from mmidx.io.ray_cluster import TRANSIENT_ERRNOS, TransientOSError, ray_cluster, task_exception

MAX_RETRIES = 3


WINDOW_PER_CPU = 2


def _ray_build_unit(plan: BuildPlan, index: int) -> dict[str, Any]:
    """The body of one Ray task (runs in a worker process, which keeps its tokenizer between tasks)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per task
    try:
        return build_unit(plan, index, tokenizer_for(plan), lambda *delta: None)
    except OSError as error:
        if error.errno in TRANSIENT_ERRNOS:
            raise TransientOSError(error.errno, error.strerror, error.filename) from error
        raise


class RayEngine:
    """Units as tasks of the Ray cluster at ``address`` (default: ``RAY_ADDRESS`` or a new local one)."""

    def __init__(self, address: str | None, workers: int):
        self.address = address
        self.workers = workers

    def run(self, plan: BuildPlan, todo: list[int], progress: BuildProgress) -> dict[int, dict[str, Any]]:
        with ray_cluster(self.address, self.workers) as ray:
            return self._run(ray, plan, todo, progress)

    def _run(self, ray: Any, plan: BuildPlan, todo: list[int], progress: BuildProgress) -> dict[int, dict[str, Any]]:
        task = ray.remote(_ray_build_unit).options(num_cpus=1, max_retries=MAX_RETRIES,
                                                    retry_exceptions=[TransientOSError])
        window = max(1, int(ray.cluster_resources().get("CPU", 1)) * WINDOW_PER_CPU)
        plan_ref = ray.put(plan)
        waiting = list(reversed(todo))
        in_flight: dict[Any, int] = {}
        reports: dict[int, dict[str, Any]] = {}
        try:
            while waiting or in_flight:
                while waiting and len(in_flight) < window:
                    index = waiting.pop()
                    in_flight[task.remote(plan_ref, index)] = index
                done, _ = ray.wait(list(in_flight), num_returns=1)
                for ref in done:
                    index = in_flight.pop(ref)
                    with failure_names(plan, index):
                        reports[index] = _result(ray, ref)
                    progress.shard_done(reports[index], counted=False)
        except BaseException:
            for ref in in_flight:
                ray.cancel(ref, force=True)
            raise
        return reports


def _result(ray: Any, ref: Any) -> dict[str, Any]:
    """The task's report; its own exception (not Ray's wrapper) when it failed."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as error:
        raise task_exception(ray, error) from None
