"""What balanced steps after CFG dropout cost each rank: pricing one global batch (:class:`PackCosts`, every rank,
once per global batch) at G = 8 and G = 512, against the straightforward per-sample form of its draws, interleaved.

    python benchmarks/bench_deal.py mmidx-demo/datasets/data.yaml          # the (full) demo's data, a long stream

Sides, per global batch (the same batches, taking turns):

* ``PackCosts``: the batch's costs after dropout (the plan records of its samples, their Philox uniforms evaluated
  in numpy, the one dropout decision, the cost model) and the deal;
* ``per-sample draws``: only the uniforms, drawn sample by sample with numpy's generator (``sample_randomness``,
  what the builder calls): a lower bound of pricing the batch without the vectorised draws.

Besides the ratio (of CPU seconds): milliseconds per global batch (wall and CPU), and the wall time as a share of
what one rank computes in the same global batch at Qwen2-7B's default demand (G / W micro-steps of the packs'
modelled seconds, W = G / 8); and the whole index priced at once (``pack_index_costs``, what ``mmidx index
--world-size`` does), per million samples.

Then what the deal buys (deterministic, no timing): the step balance (:func:`mmidx.index.cost.step_balance`'s
measure, mean ÷ slowest rank per micro-step) of the costs after dropout, what the accelerators compute, when each
global batch is dealt by the pack index's sizes (every element kept: the deal before ``PackCosts``), by the costs
after dropout, and in contiguous shares.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np

from mmidx.config import DataConfig
from mmidx.index.accelerator import demand
from mmidx.index.cost import deal_by_cost, pack_costs, step_balance
from mmidx.index.dropout import sample_randomness
from mmidx.index.pack_costs import PackCosts
from mmidx.index.pack_index import PackIndex, build_pack_index, pack_index_costs
from mmidx.index.sizes import view_table
from mmidx.read.dataset import MMIDXDataset

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Watch, interleave, machine, ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a data.yaml (e.g. the demo's)")
    parser.add_argument("--num-samples", type=int, default=200_000, help="the stream's length (default 200,000)")
    parser.add_argument("--batches", type=int, default=8, help="global batches timed per round (default 8)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = DataConfig.from_yaml(args.config)
    with tempfile.TemporaryDirectory(prefix="bench-deal-") as cache, Watch() as watch:
        index = build_pack_index(config, num_samples=args.num_samples, cache_dir=cache, progress=False)
        costs = PackCosts(index)
        offsets = np.asarray(index.arrays["pack_offsets"], dtype=np.int64)
        start = time.process_time()
        whole = pack_index_costs(index)
        whole_s = time.process_time() - start
        _, tokens = costs.sample_tokens(0, len(index))
        accelerator = demand("qwen2-7b", float(whole.sum() / tokens.sum()), attention="flex")
        print(f"# {args.config}: {args.num_samples:,} samples, {len(index):,} packs "
              f"({len(tokens) / len(index):.1f} samples a pack); {machine('numpy')}")
        print(f"whole index priced at once: {whole_s:.2f} CPU s, {whole_s / len(tokens) * 1e6:.2f} CPU s per million "
              "samples")
        print(f"{'G':>4} {'W':>3} {'samples':>8} {'PackCosts ms':>12} {'CPU ms':>7} {'µs/sample':>9} "
              f"{'share of compute':>16} {'per-sample draws ÷ PackCosts (CPU)':>36}")
        for g in (8, 512):
            world = g // 8
            batches = list(range(1, min(args.batches, len(index) // g - 1) + 1))

            def priced(batch: int, g: int = g, world: int = world) -> int:
                return int(deal_by_cost(costs[batch * g:(batch + 1) * g], world)[0])

            def drawn(batch: int, g: int = g) -> int:
                for pack in range(batch * g, (batch + 1) * g):
                    for position, item in enumerate(index.items(pack)):
                        sample = costs.datasets[item.group][item.dataset][item.sample]
                        sample_randomness(config.seed, pack, position, len(sample.elements(item.view)))
                return batch

            priced(batches[0])  # the datasets' structure checks, once per process, out of the timing
            turns = interleave({"PackCosts": priced, "per-sample draws": drawn}, batches, args.rounds)
            per_batch = statistics.median(t for round_ in turns.wall["PackCosts"] for t in round_)
            cpu = statistics.median(t for round_ in turns.cpu["PackCosts"] for t in round_)
            samples = statistics.mean(offsets[(b + 1) * g] - offsets[b * g] for b in batches)
            compute = statistics.mean(accelerator.seconds(float(whole[b * g:(b + 1) * g].sum())) / world
                                      for b in batches)
            slower = ratio(turns.per_round("per-sample draws"), turns.per_round("PackCosts"))
            print(f"{g:>4} {world:>3} {samples:>8.0f} {per_batch * 1e3:>12.2f} {cpu * 1e3:>7.2f} "
                  f"{cpu / samples * 1e6:>9.2f} {per_batch / compute:>16.2e} {slower!s:>36}")
        print(f"{'W':>3} {'G':>4} {'dealt by index sizes':>21} {'dealt after dropout':>20} {'contiguous':>11}   "
              "(step balance of the costs after dropout)")
        indexed = indexed_costs(index, costs.datasets)
        for world, g in ((2, 16), (8, 64), (64, 512)):
            print(f"{world:>3} {g:>4} {balance_of(whole, indexed, g, world):>21.4f} "
                  f"{step_balance(whole, g, world, balanced=True):>20.4f} "
                  f"{step_balance(whole, g, world, balanced=False):>11.4f}")
    print(f"# {watch.describe()}")


def indexed_costs(index: PackIndex, datasets: list[list[MMIDXDataset]]) -> np.ndarray:
    """Each pack's cost from the pack index's sizes of its samples, every element kept (what balanced steps dealt
    by before they priced CFG dropout)."""
    table = view_table(index.config, datasets, index.selections)
    samples = np.asarray(index.arrays["samples"], dtype=np.int64)
    views = np.asarray(index.arrays["views"], dtype=np.int64) if "views" in index.arrays else np.zeros_like(samples)
    return pack_costs(np.asarray(index.arrays["pack_offsets"], dtype=np.int64),
                      table.tokens_of(samples, views))


def balance_of(actual: np.ndarray, dealt_by: np.ndarray, g: int, world: int) -> float:
    """Mean over micro-steps of mean ÷ slowest rank of ``actual`` costs, each global batch dealt by ``dealt_by``."""
    ratios = []
    for batch in range(len(actual) // g):
        packs = slice(batch * g, (batch + 1) * g)
        steps = actual[packs][deal_by_cost(dealt_by[packs], world)].reshape(-1, world)
        ratios.extend(steps.mean(axis=1) / steps.max(axis=1))
    return float(np.mean(ratios))


if __name__ == "__main__":
    main()
