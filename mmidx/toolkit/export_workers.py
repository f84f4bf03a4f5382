"""``mmidx export --workers N [--engine ray]``: an export's row groups made on worker processes or Ray actors, and
handed back in their order.

A job is a picklable object with ``open()`` (what one worker needs: the dataset opened; called once per worker)
and ``run(state, task)`` (one row group's rows). :func:`ordered_results` runs the tasks in this process (one
worker), in forked processes that die with their parent, or on Ray actors (the dataset must be readable where
they run, as for a Ray build; an actor that dies is restarted and its task retried). At most :data:`WINDOW`
tasks per worker are in flight, so what waits to be written is bounded, and the results come back in the tasks'
order, so that the files written from them are the same bytes at any worker count. Each worker tokenizes on one
core (``TOKENIZERS_PARALLELISM=false``): ``--workers N`` uses N cores.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from mmidx.errors import MMIDXError
from mmidx.io.libc import die_with_parent
from mmidx.io.ray_cluster import ray_cluster, task_exception

WINDOW = 2  # tasks in flight per worker
MAX_RETRIES = 3  # restarts of a Ray actor that died, and retries of its task
ENGINES = ("local", "ray")


class WorkerDied(MMIDXError, RuntimeError):
    """A worker process ended in the middle of a task (killed, or out of memory)."""


DIED = ("a worker process died in the middle of the export (killed, or out of memory?); nothing was kept: run it "
        "again, with fewer --workers if memory is short")


class Job(Protocol):
    def open(self) -> Any:
        """What a worker keeps between tasks (called once per worker, in it)."""

    def run(self, state: Any, task: Any) -> Any:
        """The result of one task."""


@dataclass(frozen=True)
class Workers:
    """How an export runs (nothing here changes its files): ``workers`` processes, or Ray actors with
    ``engine="ray"`` on the cluster at ``ray_address`` (default: ``RAY_ADDRESS``, else a new local one)."""

    workers: int = 1
    engine: str = "local"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")


def ordered_results(job: Job, tasks: Iterable[Any], run: Workers) -> Iterator[tuple[Any, Any]]:
    """(task, result) for every task, in the tasks' order."""
    if run.engine == "ray":
        yield from _ray(job, tasks, run)
        return
    with _one_core_each():
        if run.workers == 1:
            state = job.open()
            for task in tasks:
                yield task, job.run(state, task)
        else:
            yield from _pool(job, tasks, run.workers)


@contextmanager
def _one_core_each() -> Iterator[None]:
    """Tokenizers' batch calls on one core in this process and the processes it forks, for the time of the block."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


_job: Job | None = None  # a pool worker's job and state
_state: Any = None


def _start_worker(parent: int, job: Job) -> None:
    global _job, _state
    die_with_parent(parent)
    _job, _state = job, job.open()


def _run_task(task: Any) -> Any:
    assert _job is not None
    return _job.run(_state, task)


def _pool(job: Job, tasks: Iterable[Any], workers: int) -> Iterator[tuple[Any, Any]]:
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    pending: deque[tuple[Any, Future]] = deque()
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                             initargs=(os.getpid(), job)) as pool:
        try:
            for task in tasks:
                pending.append((task, pool.submit(_run_task, task)))
                if len(pending) >= WINDOW * workers:
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()
        except BrokenProcessPool:
            raise WorkerDied(DIED) from None
        finally:
            for _, future in pending:
                future.cancel()


class _Actor:
    """One Ray worker: the job's state opened at its first task (so that an error doing it is the task's)."""

    def __init__(self, job: Job):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.job, self.state, self.opened = job, None, False

    def run(self, task: Any) -> Any:
        if not self.opened:
            self.state, self.opened = self.job.open(), True
        return self.job.run(self.state, task)


def _ray(job: Job, tasks: Iterable[Any], run: Workers) -> Iterator[tuple[Any, Any]]:
    with ray_cluster(run.ray_address, run.workers) as ray:
        from ray.util import ActorPool

        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus < run.workers:
            raise ValueError(f"--workers {run.workers}: the Ray cluster has {cpus} CPUs, and each worker takes one; "
                             f"give at most --workers {cpus}")
        actor = ray.remote(num_cpus=1, max_restarts=MAX_RETRIES, max_task_retries=MAX_RETRIES)(_Actor)
        job_ref = ray.put(job)
        actors = [actor.remote(job_ref) for _ in range(run.workers)]
        pool, pending = ActorPool(actors), deque()
        try:
            for task in tasks:
                pool.submit(lambda worker, value: worker.run.remote(value), task)
                pending.append(task)
                if len(pending) >= WINDOW * run.workers:
                    yield pending.popleft(), pool.get_next()
            while pending:
                yield pending.popleft(), pool.get_next()
        except ray.exceptions.RayTaskError as error:
            raise task_exception(ray, error) from None
        except ray.exceptions.RayActorError:  # died more than MAX_RETRIES times
            raise WorkerDied(DIED) from None
        finally:
            for worker in actors:
                ray.kill(worker)
