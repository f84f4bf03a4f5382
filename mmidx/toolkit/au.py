"""Accelerator utilisation (AU) as MLPerf Storage measures it: the step loop of an emulated accelerator and the
accounting that real (:mod:`mmidx.toolkit.au_ranks`) and dry runs share.

MLPerf Storage (mlcommons/storage) emulates each accelerator by sleeping the compute time of the batch it received
(Submission_guidelines.md §2.1) and reports AU = total compute time ÷ total running time, the first step's I/O
excluded (Rules.md §3.3.2 *trainingAcceleratorUtilizationCheck*); a result is the mean of 5 consecutive runs
(Submission_guidelines.md §3), and a 3D U-Net or ResNet-50 run passes at 90% (§2.1, Table 1).

Here each rank takes its micro-batch (the time it waits is its *data stall*), sleeps the batch's modelled compute
time (:class:`mmidx.index.accelerator.Demand`), and ends the micro-step in an all-reduce, as DDP and FSDP do (and
BAGEL's trainer, which all-reduces token counts every micro-step): the time it waits there for slower ranks is its
*balance wait*. A rank's wall time is exactly the sum of the three (and of the sleep's overshoot, ``other_s``),
step after step; its AU is its modelled compute ÷ its wall time, and the run's AU their mean over ranks.

A dry run (:func:`dry_run`) is the same accounting with the loader left out: no stall, sleeps of exactly the
modelled time, each rank waiting for the dearest pack of its micro-step. What is left of AU there is step
balance; a real run's AU below it is what the loader (and the harness) cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmidx.index.cost import LLMGeometry, pack_costs
from mmidx.train.shares import GlobalBatchSampler

CPU_PARTS = ("workers", "build", "trainer", "total")  # cpu_s_per_pack's keys (summarize)
PASS_BAR = 0.9  # MLPerf Storage's minimum AU for a 3D U-Net or ResNet-50 run (Submission_guidelines.md, Table 1)


@dataclass(frozen=True)
class Received:
    """A micro-batch as a rank's trainer holds it (moved and finished as a trainer does): its real tokens, its
    forward FLOPs (:func:`~mmidx.index.cost.pack_costs` of its samples at the model's geometry), and the CPU
    seconds it cost: ``trainer_cpu_s`` in the rank's own process (receiving and finishing it, and building it
    when there is no worker), ``worker_cpu_s`` in the loader worker that built it, all its threads, and
    ``build_cpu_s`` the part its main thread spent (building it; the rest is handing it over: the queue's thread
    pickles it, torch copying into shared memory whatever is not there yet). Both 0 without workers; None when
    unknown (a worker's first batch, whose CPU time includes the worker's start)."""

    tokens: int
    flops: float
    trainer_cpu_s: float = 0.0
    worker_cpu_s: float | None = 0.0
    build_cpu_s: float | None = 0.0


class WorkerClocks:
    """The CPU seconds each pack cost its loader worker, from the stamps the worker sends with its packs (its
    id, its process's CPU clock and its main thread's, taken as it finishes a pack): the differences between a
    worker's consecutive stamps. :meth:`stamp` is what the worker calls."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, float]] = {}

    @staticmethod
    def stamp(worker: int) -> tuple[int, float, float]:
        return worker, time.process_time(), time.thread_time()

    def cost(self, stamp: tuple[int, float, float] | None) -> tuple[float | None, float | None]:
        """(worker_cpu_s, build_cpu_s) of the pack ``stamp`` came with: 0 for a pack built without workers
        (``stamp`` None), None for a worker's first pack."""
        if stamp is None:
            return 0.0, 0.0
        worker, process, thread = stamp
        last = self._last.get(worker)
        self._last[worker] = (process, thread)
        return (None, None) if last is None else (process - last[0], thread - last[1])


def receive(packs: Iterator[tuple[Any, tuple[int, float, float] | None]], finish: Callable[[Any], tuple[int, Any]],
            geometry: LLMGeometry) -> Iterator[Received]:
    """A loader's ``(batch, worker stamp)`` items as a trainer holds them: ``finish(batch)`` does what the trainer
    does with a batch and returns its real tokens and its samples' lengths (FLOPs: their
    :func:`~mmidx.index.cost.pack_costs` at ``geometry``); the trainer's CPU is this thread's while it waits for,
    receives and finishes the batch, the worker's from its stamps (:class:`WorkerClocks`)."""
    clocks = WorkerClocks()
    while True:
        cpu = time.thread_time()
        item = next(packs, None)
        if item is None:
            return
        batch, stamp = item
        tokens, sample_lens = finish(batch)
        lengths = np.asarray(sample_lens, dtype=np.int64)
        flops = float(pack_costs(np.array([0, len(lengths)]), lengths, geometry)[0])
        yield Received(int(tokens), flops, time.thread_time() - cpu, *clocks.cost(stamp))


@dataclass(frozen=True)
class Step:
    """One rank's micro-step in seconds: waiting for its batch (``stall_s``), its modelled compute (``compute_s``)
    and the time the sleep for it took (``slept_s``, a little more), waiting at the all-reduce (``wait_s``)."""

    stall_s: float
    compute_s: float
    slept_s: float
    wait_s: float
    batch: Received

    @property
    def wall_s(self) -> float:
        return self.stall_s + self.slept_s + self.wait_s


GO_ON, LAST, EMPTY = 0, 1, 2  # a rank's vote at a step's all-reduce: its maximum over the ranks is what all do


def run_steps(batches: Iterator[Received], steps: int, seconds: Callable[[float], float], *,
              all_reduce: Callable[[int], int], deadline: float,
              clock: Callable[[], float] = time.perf_counter,
              sleep: Callable[[float], None] = time.sleep) -> tuple[list[Step], bool]:
    """Up to ``steps`` micro-steps of one rank: take a batch, sleep ``seconds(batch.flops)``, all-reduce.

    ``all_reduce(vote)`` is the step's all-reduce (the maximum of every rank's vote): a rank votes ``LAST`` once
    its ``clock()`` is past ``deadline`` (every rank keeps this step and stops), ``EMPTY`` when its batches ran
    out (every rank drops this step and stops), else ``GO_ON``. So all ranks take the same steps and none waits
    forever for another. Returns the steps kept, timed back to back from this call on, and whether the ranks
    stopped early.
    """
    taken: list[Step] = []
    start = clock()
    for _ in range(steps):
        batch = next(batches, None)
        ready = clock()
        if batch is None:
            all_reduce(EMPTY)
            return taken, True
        compute = seconds(batch.flops)
        sleep(compute)
        slept = clock()
        verdict = all_reduce(LAST if slept > deadline else GO_ON)
        done = clock()
        if verdict == EMPTY:
            return taken, True
        taken.append(Step(ready - start, compute, slept - ready, done - slept, batch))
        start = done
        if verdict == LAST:
            return taken, True
    return taken, False


def summarize(ranks: Sequence[Sequence[Step]], max_num_tokens: int) -> dict[str, Any]:
    """The figures of one run from each rank's measured steps: AU (mean over ranks of own compute ÷ wall), data
    stall, balance wait and the sleeps' overshoot (``other_s``; seconds per rank, mean over ranks), fill (tokens ÷
    ``max_num_tokens`` over every batch), CPU seconds per pack and the cores one accelerator needs."""
    steps = [step for rank in ranks for step in rank]
    if not steps or any(not rank for rank in ranks):
        raise ValueError("every rank needs at least one measured step: raise the time limit or the steps")

    def per_rank(value: Callable[[Step], float]) -> float:
        return float(np.mean([sum(value(step) for step in rank) for rank in ranks]))

    known = [step.batch for step in steps if step.batch.worker_cpu_s is not None]
    workers = float(np.mean([batch.worker_cpu_s for batch in known])) if known else None
    trainer = float(np.mean([step.batch.trainer_cpu_s for step in steps]))
    cpu = {"workers": workers, "build": float(np.mean([batch.build_cpu_s for batch in known])) if known else None,
           "trainer": trainer, "total": None if workers is None else trainer + workers}
    compute_per_pack = float(np.mean([step.compute_s for step in steps]))
    return {"au": float(np.mean([sum(s.compute_s for s in rank) / sum(s.wall_s for s in rank) for rank in ranks])),
            "au_per_rank": [sum(s.compute_s for s in rank) / sum(s.wall_s for s in rank) for rank in ranks],
            "steps": min(len(rank) for rank in ranks), "wall_s": per_rank(lambda s: s.wall_s),
            "compute_s": per_rank(lambda s: s.compute_s), "data_stall_s": per_rank(lambda s: s.stall_s),
            "balance_wait_s": per_rank(lambda s: s.wait_s), "other_s": per_rank(lambda s: s.slept_s - s.compute_s),
            "fill": sum(step.batch.tokens for step in steps) / (len(steps) * max_num_tokens),
            "cpu_s_per_pack": cpu, "packs_per_s_per_accelerator": 1 / compute_per_pack if compute_per_pack else None,
            "cores_per_accelerator": cpu["total"] / compute_per_pack if cpu["total"] is not None and compute_per_pack
            else None}


def combine(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' figures as one report: AU's median, minimum and mean (MLPerf Storage's result) over the runs,
    the other figures' medians, and whether every run passes MLPerf Storage's bar."""
    def median(key: str, inner: str | None = None) -> float | None:
        values = [run[key] if inner is None else run[key][inner] for run in runs]
        values = [value for value in values if value is not None]
        return statistics.median(values) if values else None

    keys = ("data_stall_s", "balance_wait_s", "other_s", "compute_s", "wall_s", "fill", "packs_per_s_per_accelerator",
            "cores_per_accelerator")
    return {"au": median("au"), "au_min": min(run["au"] for run in runs),
            "au_mean": statistics.fmean(run["au"] for run in runs), **{key: median(key) for key in keys},
            "cpu_s_per_pack": {part: median("cpu_s_per_pack", part) for part in CPU_PARTS},
            "passes": min(run["au"] for run in runs) >= PASS_BAR}


def rank_packs(num_packs: int, global_batch_size: int, world_size: int, first_step: int, steps: int,
               pack_costs: np.ndarray | None = None) -> np.ndarray:
    """The pack each rank trains on at micro-steps ``first_step`` … ``first_step + steps - 1``, ``[step, rank]``: the
    loader's own sampler (:class:`~mmidx.train.shares.GlobalBatchSampler`, balanced with ``pack_costs``)."""
    sampler = GlobalBatchSampler(num_packs, global_batch_size=global_batch_size, world_size=world_size,
                                 pack_costs=pack_costs)  # one deal per global batch serves every rank
    if first_step + steps > len(sampler):
        raise ValueError(f"{num_packs} packs hold {len(sampler)} micro-steps per rank, not {first_step + steps}")
    packs = np.empty((steps, world_size), dtype=np.int64)
    for step in range(first_step, first_step + steps):
        global_batch, position = divmod(step, sampler.per_rank)
        packs[step - first_step] = sampler.deal(global_batch)[position * world_size:(position + 1) * world_size]
    return packs


def dry_run(compute_s: np.ndarray, tokens: np.ndarray, flops: np.ndarray, max_num_tokens: int) -> dict[str, Any]:
    """:func:`summarize` of an emulation without a loader: ``compute_s[step, rank]`` (and the batches' ``tokens`` and
    ``flops``, same shape) as modelled, no stall, sleeps of exactly that time, every rank leaving the all-reduce when
    the dearest pack of its micro-step is done."""
    slowest = compute_s.max(axis=1, keepdims=True)
    ranks = [[Step(0.0, float(c), float(c), float(w), Received(int(n), float(f), 0.0, None, None))
              for c, w, n, f in zip(compute_s[:, r], (slowest - compute_s)[:, r], tokens[:, r], flops[:, r],
                                    strict=True)]
             for r in range(compute_s.shape[1])]
    return summarize(ranks, max_num_tokens)
