"""The ranks of ``mmidx bench --au``: one process per emulated accelerator in a ``torch.distributed`` gloo group on
127.0.0.1, each taking its own batches from a *feed* (:class:`PackFeed`: its own :class:`PackLoader`) and stepping
with the others (:func:`mmidx.toolkit.au.run_steps`).

A feed is any picklable object with ``open(rank, world_size)`` (called once in the rank's process),
``batches()`` (a fresh iterator of :class:`~mmidx.toolkit.au.Received` per run, continuing the stream: new loader
workers, as a new job would start) and ``position`` (micro-steps this rank has taken), so another loader (BAGEL's,
in ``benchmarks/bench_au.py``) runs in the same harness.
"""

from __future__ import annotations

import multiprocessing
import queue
import socket
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from mmidx.config import DataConfig
from mmidx.errors import MMIDXError
from mmidx.index.cost import LLMGeometry
from mmidx.pack.batch import PackedBatch
from mmidx.toolkit.au import GO_ON, Received, Step, WorkerClocks, receive, run_steps
from mmidx.train.loader import PackDataset, PackLoader

STARTUP_S = 120  # a rank's start (imports, the process group, the pack index, its loader), beyond the runs' limits


class AUError(MMIDXError, RuntimeError):
    """A rank of an AU run that failed, died or did not finish in time."""


class Feed(Protocol):
    position: int

    def open(self, rank: int, world_size: int) -> None: ...

    def batches(self) -> Iterator[Received]: ...


class _StampedPacks(PackDataset):
    """A :class:`PackDataset` whose items also carry the stamp of the loader worker that built them
    (:meth:`WorkerClocks.stamp`; None when built in the rank's process)."""

    def __getitem__(self, index: int) -> Any:
        batch = super().__getitem__(index)
        worker = torch.utils.data.get_worker_info()
        return batch, None if worker is None else WorkerClocks.stamp(worker.id)


class PackFeed:
    """mmidx's loader for one rank: a :class:`PackLoader` over ``config``'s pack index of ``num_samples`` (cached
    in ``cache_dir``, where the caller built it), each batch finished as BAGEL's trainer does
    (``batch.to(device).to_dict()``: dense masks are built there, deferred images decoded), its FLOPs from its
    samples at ``geometry``; ``balanced``: each global batch dealt by its packs' costs after CFG dropout at
    ``geometry`` (:class:`~mmidx.index.pack_costs.PackCosts`), else in contiguous shares; ``decode`` and
    ``encodings`` as :class:`~mmidx.pack.builder.PackBuilder` takes them."""

    def __init__(self, config: DataConfig, *, num_samples: int, cache_dir: str, global_batch_size: int,
                 workers: int, masks: str, device: str, geometry: LLMGeometry, balanced: bool = True,
                 prefetch_factor: int | None = None, decode: str = "loader", encodings: dict[str, str] | None = None):
        self.config, self.num_samples, self.cache_dir = config, num_samples, cache_dir
        self.global_batch_size, self.workers, self.masks, self.device = global_batch_size, workers, masks, device
        self.geometry, self.balanced, self.prefetch_factor = geometry, balanced, prefetch_factor
        self.decode, self.encodings = decode, encodings
        self.loader: PackLoader | None = None

    def open(self, rank: int, world_size: int) -> None:
        from mmidx.index.pack_costs import PackCosts
        from mmidx.index.pack_index import build_pack_index
        from mmidx.pack.builder import PackBuilder

        index = build_pack_index(self.config, num_samples=self.num_samples, cache_dir=self.cache_dir, progress=False)
        builder = PackBuilder(self.config, use_flex=self.masks != "dense", decode_images=self.decode,
                              encodings=self.encodings)
        dataset = _StampedPacks(index, builder)
        costs = PackCosts(index, self.geometry, config=self.config, datasets=builder.datasets) if self.balanced \
            else None
        self.loader = PackLoader(dataset, global_batch_size=self.global_batch_size, rank=rank, world_size=world_size,
                                 num_workers=self.workers, prefetch_factor=self.prefetch_factor, pack_costs=costs)

    @property
    def position(self) -> int:
        return self.loader.steps_consumed if self.loader else 0

    def batches(self) -> Iterator[Received]:
        packs = iter(self.loader)
        try:
            yield from receive(packs, self._finish, self.geometry)
        finally:
            packs.close()  # stop the workers now, not whenever the generator is collected

    def _finish(self, batch: PackedBatch) -> tuple[int, list[int]]:
        batch.to(self.device).to_dict()  # what the trainer does with it; dropped at once
        return batch.sequence_length, batch.sample_lens


@dataclass(frozen=True)
class RankSpec:
    """What every rank runs: its feed, the world, the runs (warm-up and measured micro-steps, a time limit each)
    and the accelerator's seconds per FLOP."""

    feed: Any
    world_size: int
    port: int
    runs: int
    warmup: int
    steps: int
    time_limit: float
    seconds_per_flop: float
    start_method: str  # the parent's default: loader workers start as under a launcher such as torchrun


def _rank(rank: int, spec: RankSpec, results: Any) -> None:
    """One rank's process: join the group, open the feed, then per run warm up and measure, reporting each run's
    first measured micro-step and steps to ``results``."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    multiprocessing.set_start_method(spec.start_method, force=True)  # a spawned process's default is spawn
    torch.set_num_threads(1)  # the trainer's CPU work timed on one thread (CPU seconds of the thread are all of it)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
                                world_size=spec.world_size, timeout=timedelta(seconds=spec.time_limit + STARTUP_S))

        def all_reduce(vote: int) -> int:
            votes = torch.tensor([vote], dtype=torch.int64)
            dist.all_reduce(votes, op=dist.ReduceOp.MAX)
            return int(votes.item())

        def seconds(flops: float) -> float:
            return flops * spec.seconds_per_flop

        spec.feed.open(rank, spec.world_size)
        all_reduce(GO_ON)  # every rank ready before the first run's clock starts
        for run in range(spec.runs):
            batches = spec.feed.batches()
            deadline = time.perf_counter() + spec.time_limit
            try:
                _, stopped = run_steps(batches, spec.warmup, seconds, all_reduce=all_reduce,
                                       deadline=deadline)
                first = spec.feed.position
                measured, _ = run_steps(batches, 0 if stopped else spec.steps, seconds,
                                        all_reduce=all_reduce, deadline=deadline)
            finally:
                batches.close()
            results.put(("run", rank, run, first, measured))
        results.put(("done", rank))
    except Exception as error:  # reported to the parent, which ends the other ranks and says it in one line
        where = traceback.extract_tb(error.__traceback__)[-1]
        results.put(("error", rank, f"{type(error).__name__}: {error} (at {where.filename}:{where.lineno})"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(feed: Feed, *, world_size: int, runs: int, warmup: int, steps: int, time_limit: float,
              seconds_per_flop: float) -> list[tuple[int, list[list[Step]]]]:
    """Start ``world_size`` rank processes (spawned) on ``feed`` and return per run its first measured micro-step
    and each rank's measured steps. A rank that fails, dies or outlives every run's time limit (and
    :data:`STARTUP_S`) ends them all: :class:`AUError`, naming the rank and the cause."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    spec = RankSpec(feed, world_size, _free_port(), runs, warmup, steps, time_limit, seconds_per_flop,
                    multiprocessing.get_start_method())
    processes = [context.Process(target=_rank, args=(rank, spec, results), name=f"mmidx-au-rank-{rank}")
                 for rank in range(world_size)]
    deadline = time.monotonic() + STARTUP_S + runs * (time_limit + 30)
    measured: dict[int, tuple[int, list[list[Step] | None]]] = {}
    done: set[int] = set()
    try:
        for process in processes:
            process.start()
        while len(done) < world_size:
            try:
                message = results.get(timeout=1.0)
            except queue.Empty:
                dead = [rank for rank, p in enumerate(processes) if rank not in done and p.exitcode is not None]
                if dead:
                    raise AUError(f"rank {dead[0]} died (exit code {processes[dead[0]].exitcode}) before it reported: "
                                  "its own output above says why (killed: out of memory?)") from None
                if time.monotonic() > deadline:
                    raise AUError(f"the ranks did not finish {runs} run(s) within their time limit of {time_limit:g} "
                                  f"s each (and {STARTUP_S} s to start): a loader that hangs?") from None
                continue
            if message[0] == "error":
                raise AUError(f"rank {message[1]}: {message[2]}")
            if message[0] == "done":
                done.add(message[1])
                continue
            _, rank, run, first, steps_taken = message
            entry = measured.setdefault(run, (first, [None] * world_size))
            entry[1][rank] = steps_taken
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join(timeout=30)
        results.close()
    return [(measured[run][0], measured[run][1]) for run in sorted(measured)]

