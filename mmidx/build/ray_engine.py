"""The Ray engine: each work unit is one Ray task on one CPU of a cluster.

Ray is optional (``pip install "mmidx[ray]"``) and imported only here. The plan is put into the
object store once; each task builds its unit with :func:`mmidx.build.shard.build_unit`, whose
attempt folders and publishing rename make retried or duplicated tasks harmless. A task is retried
(at most ``MAX_RETRIES`` times) when its worker process dies and when it fails with a transient
``OSError`` (I/O error, timeout, stale network file handle...); a bad row is never a failure, it is
a counted skip. The driver keeps at most ``WINDOW_PER_CPU`` tasks per cluster CPU in flight.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mmidx.build.engines import BuildProgress, failure_names
from mmidx.build.plan import BuildError, BuildPlan
from mmidx.build.shard import build_unit, tokenizer_for

MAX_RETRIES = 3
WINDOW_PER_CPU = 2
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET,
                              errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ESTALE, errno.EBUSY})


class TransientOSError(OSError):
    """An OSError worth retrying the task for (Ray retries exactly this type)."""


def import_ray() -> Any:
    """The ``ray`` module, or a BuildError that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise BuildError('--engine ray needs Ray: pip install "mmidx[ray]" (or pip install ray)') from error
    return ray


def _ray_build_unit(plan: BuildPlan, index: int) -> dict[str, Any]:
    """The body of one Ray task (runs in a worker process, which keeps its tokenizer between tasks)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per task
    try:
        return build_unit(plan, index, tokenizer_for(plan), lambda *delta: None)
    except OSError as error:
        if error.errno in TRANSIENT_ERRNOS:
            raise TransientOSError(error.errno, error.strerror, error.filename) from error
        raise


@contextmanager
def ray_cluster(address: str | None, workers: int) -> Iterator[Any]:
    """The ``ray`` module, joined to the cluster at ``address`` (default: ``RAY_ADDRESS``, else a local
    one of ``workers`` CPUs and no dashboard) unless Ray is initialised already; shut down if started here."""
    ray = import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        local = {} if address else {"num_cpus": workers, "include_dashboard": False}
        ray.init(address=address, log_to_driver=False, configure_logging=False, **local)
    try:
        yield ray
    finally:
        if started_here:
            ray.shutdown()


def task_exception(ray: Any, error: Exception) -> BaseException:
    """A task's own exception out of Ray's ``RayTaskError`` wrapper (the wrapper when it has none)."""
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, BaseException):
        return error.cause
    return error


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
