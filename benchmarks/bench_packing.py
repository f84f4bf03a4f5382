"""Packing for GPU time: fill, step balance and GPU efficiency of the bagel and tight policies (tight with its
default cost cap, and with tokens only: ``cost_slack=None``), contiguous and balanced steps, at world 8 and 64
with G = 8·W and G = W; TRL's ``pack_dataset(strategy="bfd")`` on the
same lengths as the in-run peer (fill and speed); the pack-index build time, tight ÷ bagel.

    python benchmarks/bench_packing.py                      # 10^6 samples a mix, build at 10^6
    python benchmarks/bench_packing.py --build-samples 100000000   # the 10^8 build (minutes, quiet machine)

Mixes (lognormal token counts, clipped to [16, 16384], blended by mmidx's deterministic blend):
scale (bench_index.py's t2i/edit/vlm: ~1,100/5,000/1,500 tokens, weights 0.5/0.2/0.3), text (a text-only
lognormal mix, ~600/2,000 tokens, 0.7/0.3), video (~12,000/1,500/800 tokens, 0.4/0.3/0.3).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from mmidx.index.cost import pack_costs, step_balance
from mmidx.index.packer import pack_samples
from mmidx.index.stream import multimodal_stream

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Watch, interleave, machine, ratio

MIXES = {"scale": ([1100, 5000, 1500], [0.5, 0.2, 0.3]), "text": ([600, 2000], [0.7, 0.3]),
         "video": ([12000, 1500, 800], [0.4, 0.3, 0.3])}
CAP = 36864
VARIANTS = {"bagel": {"policy": "bagel"}, "tight, tokens only": {"policy": "tight", "cost_slack": None},
            "tight": {"policy": "tight"}}  # tight: the default cost cap (packing.cost_slack)


def lengths(mix: str, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(token counts, groups) of ``n`` stream items of ``mix``."""
    means, weights = MIXES[mix]
    groups = multimodal_stream([n] * len(means), weights, n, seed)[0]
    rng = np.random.default_rng(seed)
    counts = np.clip(rng.lognormal(np.log(np.array(means)[groups]), 0.5), 16, 16384).astype(np.int64)
    return counts, groups


def trl_bfd(counts: np.ndarray) -> np.ndarray:
    """Pack tokens of TRL's ``pack_dataset(strategy="bfd")`` over sequences of ``counts`` lengths."""
    import datasets
    import pyarrow as pa
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()

    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(offsets[-1], np.int32)))
    dataset = Dataset(pa.table({"input_ids": ids}))
    packed = pack_dataset(dataset, seq_length=CAP, strategy="bfd")
    return np.array([len(x) for x in packed["input_ids"]])


def table(samples: int, with_trl: bool) -> None:
    print("| mix | policy | W | G | fill | balance contiguous | balance balanced | efficiency |")
    print("|---|---|---|---|---|---|---|---|")
    for mix in MIXES:
        counts, groups = lengths(mix, samples)
        for policy, options in VARIANTS.items():
            packed = pack_samples(counts, groups, mandatory=[False] * len(MIXES[mix][0]), **options)
            fill = packed.pack_tokens[:-1].mean() / CAP
            costs = pack_costs(packed.pack_offsets, counts[packed.pack_items])
            for w in (8, 64):
                for g in (8 * w, w):
                    flat, dealt = (step_balance(costs, g, w, balanced=b) for b in (False, True))
                    print(f"| {mix} | {policy} | {w} | {g} | {fill:.2%} | {flat:.2%} | {dealt:.2%} "
                          f"| {fill * dealt:.2%} |")
        if with_trl:
            tokens = trl_bfd(counts)
            print(f"| {mix} | TRL bfd | – | – | {np.sort(tokens)[1:].mean() / CAP:.2%} (last pack excluded) | | | |")


def speed(samples: int, with_trl: bool, rounds: int) -> None:
    counts, groups = lengths("scale", samples)
    sides = {policy: (lambda _, o=options: pack_samples(counts, groups, mandatory=[False] * 3, **o))
             for policy, options in VARIANTS.items()}
    if with_trl:
        sides["trl_bfd"] = lambda _: trl_bfd(counts)
    turns = interleave(sides, [None], rounds)
    for side in sides:
        if side != "bagel":
            print(f"{side} ÷ bagel, packing {samples:,} samples: "
                  f"{ratio(turns.per_round(side, 'wall'), turns.per_round('bagel', 'wall'))}")


def build(samples: int, rounds: int) -> None:
    """Pack-index build (the streamed pipeline: blend, views, packing, cache writes) tight ÷ bagel."""
    import tempfile

    from mmidx.config import DataConfig, GroupConfig, PackingConfig
    from mmidx.index.cache import cached_build
    from mmidx.index.pack_index import write_pack_index
    from mmidx.index.stream import ViewTable

    rng = np.random.default_rng(0)
    groups = (("t2i", 400_000, 1100), ("edit", 100_000, 5000), ("vlm", 200_000, 1500))
    table_ = ViewTable.of([np.arange(n + 1) for _, n, _ in groups],
                          [np.maximum(rng.normal(m, 0.3 * m, n), 1).astype(np.int64) for _, n, m in groups])

    def run(policy: str) -> float:
        config = DataConfig(groups=tuple(GroupConfig(name, (name,), w) for (name, *_), w in
                                         zip(groups, (0.5, 0.2, 0.3), strict=True)),
                            packing=PackingConfig(policy=policy))
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            cached_build(folder, {"bench": policy}, lambda sink: write_pack_index(sink, table_, config, samples))
            return time.perf_counter() - start

    turns = interleave({"bagel": lambda _: run("bagel"), "tight": lambda _: run("tight")}, [None], rounds)
    print(f"pack-index build of {samples:,} samples, tight ÷ bagel: "
          f"{ratio(turns.per_round('tight', 'wall'), turns.per_round('bagel', 'wall'))} (target ≤ 1.5×)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1_000_000, help="stream items per mix")
    parser.add_argument("--build-samples", type=int, default=1_000_000, help="samples of the pack-index build")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each timing")
    parser.add_argument("--no-trl", action="store_true", help="leave TRL's bfd packer out")
    args = parser.parse_args()
    print(machine())
    with Watch() as watch:
        table(args.samples, not args.no_trl)
        speed(min(args.samples, 200_000), not args.no_trl, args.rounds)
        build(args.build_samples, args.rounds)
    print(watch.describe())


if __name__ == "__main__":
    main()
