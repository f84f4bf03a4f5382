"""What handing a batch from a DataLoader worker to the trainer process costs: torch's reduction (each tensor moved
into a fresh shared-memory file, what mmidx did before :mod:`mmidx.pack.shared`) against mmidx's reused segments,
side by side, interleaved, as ratios.

Tables (each a subcommand; ``all`` runs them in turn):

* ``allocation``: CPU ms to have N bytes written, in one process: into a reused private buffer (the floor: the
  stores alone), into fresh ``malloc`` memory, into a fresh torch shared-memory storage
  (``UntypedStorage._new_shared``: a file created, sized, mapped, faulted in page by page), into a reused private
  buffer then moved by torch into shared memory (``share_memory_()``: what a worker's hand-over did), and into a
  reused segment;
* ``tensors``: one worker handing over a batch of one tensor of N bytes: the worker's CPU per item (all its
  threads) and the trainer's (receiving it), torch's way against a segment's: where small tensors are cheaper
  left to torch, if anywhere;
* ``packs``: bench_pack's corpus (t2i, edit, vlm, mix; 512² JPEGs), one worker building packs: the worker's CPU
  per pack (its main thread building, the rest handing over) and the trainer's, torch's way against segments.

Each round runs the sides in turn (rotating which goes first), each with a fresh DataLoader; a worker's first
item (its start) is not counted. On a loaded machine the figures are indicative (the load is printed under each
table: common.py's Watch).

    python benchmarks/bench_handover.py all
"""

from __future__ import annotations

import argparse
import statistics
import time
import unittest.mock
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bagel_peer import MODES, prepare
from bench_au import kind_config
from common import Watch, machine, ratio

from mmidx.index.pack_index import build_pack_index
from mmidx.pack import shared
from mmidx.pack.batch import PackedBatch
from mmidx.pack.builder import PackBuilder
from mmidx.toolkit.au import WorkerClocks
from mmidx.toolkit.au_ranks import _StampedPacks

SIDES = ("torch", "segments")
SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 96 << 20)


def side(name: str) -> Any:
    """A context in which DataLoader workers started inside it hand over ``name``'s way: "torch" with mmidx's
    segments switched off (the workers fork with the switch), "segments" as mmidx does."""
    if name == "torch":
        return unittest.mock.patch.object(shared, "worker_pool", lambda: None)
    return unittest.mock.patch.object(shared, "worker_pool", shared.worker_pool)


def cpu_ms(function: Callable[[], Any], repeats: int) -> float:
    """The median CPU ms of this thread over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        function()
        times.append(time.thread_time() - start)
    return 1e3 * statistics.median(times)


def table_allocation(args: argparse.Namespace) -> None:
    print("# allocation: CPU ms (median of --repeats) to have N bytes written, in one process")
    names = ("reused private", "fresh malloc", "fresh torch shm", "private + torch's move", "reused segment")
    print(f"{'bytes':>10} " + " ".join(f"{name:>22}" for name in names))
    with Watch() as watch:
        for nbytes in SIZES:
            private, pool = np.empty(nbytes, np.uint8), shared.SegmentPool()

            def fresh_shm(nbytes: int = nbytes) -> None:
                storage = torch.UntypedStorage._new_shared(nbytes)
                torch.empty(0, dtype=torch.uint8).set_(storage).fill_(1)

            def moved(private: np.ndarray = private) -> None:  # the old hand-over: a pooled buffer, then torch's move
                torch.from_numpy(private).fill_(1).share_memory_()

            def segment(pool: shared.SegmentPool = pool, nbytes: int = nbytes) -> None:
                torch.from_numpy(pool.take(nbytes)).fill_(1)
                pool.seal()

            def reused(private: np.ndarray = private) -> None:
                private.fill(1)

            def malloc(nbytes: int = nbytes) -> None:
                torch.empty(nbytes, dtype=torch.uint8).fill_(1)

            cases = (reused, malloc, fresh_shm, moved, segment)
            figures = [cpu_ms(case, args.repeats) for case in cases]
            print(f"{nbytes:>10} " + " ".join(f"{value:>22.3f}" for value in figures), flush=True)
    print(f"# {watch.describe()}")


class _Tensors(torch.utils.data.Dataset):
    """Batches of one tensor of ``nbytes`` (written in the worker), each with its worker's stamp."""

    def __init__(self, nbytes: int, count: int):
        self.nbytes, self.count = nbytes, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, k: int) -> tuple[PackedBatch, Any]:
        pool = shared.worker_pool()
        dtype = torch.uint8
        tensor = torch.empty(self.nbytes, dtype=dtype) if pool is None else pool.tensor((self.nbytes,), dtype)
        tensor.fill_(k % 256)
        if pool is not None:
            pool.seal()
        batch = PackedBatch({"packed_text_ids": tensor}, split_lens=[], attn_modes=[], sample_lens=[],
                            use_flex=True, max_num_tokens=0, batch_data_indexes=[])
        return batch, WorkerClocks.stamp(torch.utils.data.get_worker_info().id)


def handed_over(dataset: torch.utils.data.Dataset, name: str) -> list[tuple[float, float, float]]:
    """(worker CPU s, its main thread's, trainer CPU s) per item after the first, one worker, ``name``'s way."""
    clocks, costs = WorkerClocks(), []
    with side(name):
        loader = iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1))
        while True:
            start = time.thread_time()
            item = next(loader, None)
            trainer = time.thread_time() - start
            if item is None:
                break
            worker, build = clocks.cost(item[1])
            if worker is not None:
                costs.append((worker, build, trainer))
            del item
    return costs


def interleaved(make: Callable[[], torch.utils.data.Dataset], rounds: int) -> dict[str, list[list[tuple]]]:
    runs: dict[str, list[list[tuple]]] = {name: [] for name in SIDES}
    for round_ in range(rounds):
        order = SIDES[round_ % 2:] + SIDES[:round_ % 2]
        for name in order:
            runs[name].append(handed_over(make(), name))
    return runs


def means(runs: list[list[tuple]]) -> tuple[float, ...]:
    return tuple(float(np.mean([cost[part] for run in runs for cost in run])) for part in range(3))


def table_tensors(args: argparse.Namespace) -> None:
    print(f"# tensors: one worker handing over a batch of one tensor; CPU ms per item, mean over {args.rounds} "
          f"rounds of {args.items} items; torch ÷ segments of worker + trainer, median over rounds")
    print(f"{'bytes':>10} {'torch worker':>12} {'trainer':>8} {'segments worker':>15} {'trainer':>8} "
          f"{'torch ÷ segments':>28}")
    with Watch() as watch:
        for nbytes in SIZES:
            runs = interleaved(lambda nbytes=nbytes: _Tensors(nbytes, args.items), args.rounds)
            (tw, _, tt), (sw, _, st) = (means(runs[name]) for name in SIDES)
            totals = {name: [sum(c[0] + c[2] for c in run) / len(run) for run in runs[name]] for name in SIDES}
            print(f"{nbytes:>10} {1e3 * tw:>12.3f} {1e3 * tt:>8.3f} {1e3 * sw:>15.3f} {1e3 * st:>8.3f} "
                  f"{ratio(totals['torch'], totals['segments'])!s:>28}", flush=True)
    print(f"# {watch.describe()}")


def table_packs(args: argparse.Namespace) -> None:
    _, datasets = prepare(Path(args.workdir))
    print(f"# packs: bench_pack's corpus, flex, one worker; CPU s per pack, mean over {args.rounds} rounds of "
          f"{args.packs} packs (a worker's first not counted); torch ÷ segments of worker + trainer, median over "
          "rounds")
    print(f"{'kind':<5} {'side':<9} {'worker s':>8} {'build s':>7} {'rest s':>7} {'trainer s':>9} {'total s':>7} "
          f"{'torch ÷ segments':>28}")
    with Watch() as watch:
        for kind in args.kinds:
            config = kind_config(datasets, MODES[kind])
            index = build_pack_index(config, num_samples=256, cache_dir=args.workdir, progress=False)
            packs = min(len(index), args.packs + 1)

            def make(config: Any = config, index: Any = index, packs: int = packs) -> torch.utils.data.Dataset:
                return torch.utils.data.Subset(_StampedPacks(index, PackBuilder(config)), range(packs))

            runs = interleaved(make, args.rounds)
            totals = {name: [sum(c[0] + c[2] for c in run) / len(run) for run in runs[name]] for name in SIDES}
            for name in SIDES:
                worker, build, trainer = means(runs[name])
                times = str(ratio(totals["torch"], totals["segments"])) if name == "segments" else ""
                print(f"{kind:<5} {name:<9} {worker:>8.3f} {build:>7.3f} {worker - build:>7.3f} {trainer:>9.3f} "
                      f"{worker + trainer:>7.3f} {times:>28}", flush=True)
    print(f"# {watch.describe()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=("allocation", "tensors", "packs", "all"))
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-pack", help="bagel_peer's corpus and datasets")
    parser.add_argument("--kinds", default="t2i,edit,vlm,mix", type=lambda text: text.split(","))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--packs", type=int, default=12, help="packs measured per side and round (packs)")
    parser.add_argument("--items", type=int, default=20, help="items measured per side and round (tensors)")
    parser.add_argument("--repeats", type=int, default=9, help="calls per figure (allocation)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# bench_handover — {machine('torch')}")
    for table in ("allocation", "tensors", "packs") if args.table == "all" else (args.table,):
        {"allocation": table_allocation, "tensors": table_tensors, "packs": table_packs}[table](args)


if __name__ == "__main__":
    main()
