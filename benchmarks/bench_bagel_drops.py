"""How many samples BAGEL's PackedDataset drops, against mmidx's pack index, on the same corpus and budgets.

BAGEL's ``PackedDataset.__iter__`` (``data/dataset_base.py``) puts a sample that overflows the pack into a buffer
of ``max_buffer_size``; when the buffer is full, or when the sample came from the buffer, the pack is emitted and
the sample is forgotten: it is never trained on in that pass. This script runs BAGEL's own, unmodified
``PackedDataset`` over the generated corpus of bench_pack.py (benchmarks/bagel_peer.py) for ``--packs`` packs with
BAGEL's fine-tune budgets (TRAIN.md: ``--expected_num_tokens 10240 --max_num_tokens 11520
--max_num_tokens_per_sample 10240``; ``prefer_buffer_before`` 16384 and ``max_buffer_size`` 50 by default) and
counts, exactly:

* drawn: samples its group iterators yielded (counted by wrapping them);
* packed: samples ``pack_sequence`` placed in a pack (counted by wrapping it);
* skipped: samples over ``max_num_tokens_per_sample`` (its "skip a sample" message);
* buffered: samples left in its buffer when the last pack is taken (read from the generator's frame);
* dropped = drawn - packed - skipped - buffered.

mmidx's pack index over the same mmidx datasets and budgets, with as many samples as BAGEL drew, is counted the
same way (every item packed or excluded; nothing dropped, by construction and checked here).

Run: ``python benchmarks/bench_bagel_drops.py --bagel-src DIR --bagel-site DIR [--packs 200] [--modes mix,edit]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from bagel_peer import DROPOUT, MODES, bagel_commit, import_bagel, packed_dataset, prepare
from common import commit

from mmidx.config import DataConfig
from mmidx.index.pack_index import build_pack_index

FINE_TUNE = {"expected_num_tokens": 10240, "max_num_tokens": 11520, "max_num_tokens_per_sample": 10240,
             "prefer_buffer_before": 16384, "max_buffer_size": 50}


def bagel_counts(raw: Path, groups: list[str], packs: int, budgets: dict[str, int]) -> dict[str, int]:
    """Run BAGEL's PackedDataset for ``packs`` packs and count what became of every sample it drew."""
    import data.dataset_base as dataset_base

    packed = packed_dataset(raw, groups, use_flex=True, budgets=budgets)
    counts = {"drawn": 0, "packed": 0, "skipped": 0}

    def counted(iterator: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for sample in iterator:
            counts["drawn"] += 1
            yield sample

    packed.dataset_iters = [counted(iterator) for iterator in packed.dataset_iters]
    pack_sequence = packed.pack_sequence

    def packing(sample: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        counts["packed"] += 1
        return pack_sequence(sample, status)

    def message(*args: Any, **kwargs: Any) -> None:
        if args and str(args[0]).startswith("skip a sample"):
            counts["skipped"] += 1

    packed.pack_sequence = packing
    dataset_base.print = message
    generator = iter(packed)
    for _ in range(packs):
        next(generator)
    counts["buffered"] = len(generator.gi_frame.f_locals["buffer"])
    counts["dropped"] = counts["drawn"] - counts["packed"] - counts["skipped"] - counts["buffered"]
    counts["packs"] = packs
    return counts


def mmidx_counts(datasets: Path, groups: list[str], samples: int, budgets: dict[str, int]) -> dict[str, int]:
    """mmidx's pack index over ``samples`` drawn samples: how many are packed, excluded and dropped."""
    spec = yaml.safe_load((datasets / "data.yaml").read_text())
    config = DataConfig.from_dict({"groups": {g: spec["groups"][g] for g in groups}, "packing": budgets,
                                   "dropout": DROPOUT}, base_dir=datasets)
    index = build_pack_index(config, num_samples=samples, progress=False)
    placed = sum(len(index.items(k)) for k in range(len(index)))
    excluded = int(index.stats["excluded"])
    return {"drawn": samples, "packed": placed, "skipped": excluded, "buffered": 0,
            "dropped": samples - placed - excluded, "packs": len(index)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bagel-src", required=True, help="checkout of ByteDance-Seed/Bagel (its data package)")
    parser.add_argument("--bagel-site", help="folder with torchvision, decord, cv2 for BAGEL (see bagel_peer.py)")
    parser.add_argument("--bagel-commit", help="BAGEL's commit, when --bagel-src has no .git")
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-pack", help="generated corpus and datasets")
    parser.add_argument("--packs", type=int, default=200, help="BAGEL packs drawn per mode")
    parser.add_argument("--modes", default="mix,edit",
                        help="of t2i, edit, vlm, mix (t2i and vlm, of one image size each here, drop none)")
    for name, value in FINE_TUNE.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    args = parser.parse_args()
    budgets = {name: getattr(args, name) for name in FINE_TUNE}
    try:
        import_bagel(args.bagel_src, args.bagel_site)
    except ImportError as error:
        parser.error(f"BAGEL's data package does not import ({error}); pass --bagel-site with its extras")
    raw, datasets = prepare(Path(args.workdir))
    print(f"# bench_bagel_drops — mmidx {commit()}, BAGEL {bagel_commit(args.bagel_src, args.bagel_commit)}; "
          f"budgets {budgets}; load average {os.getloadavg()[0]:.2f} (counts: load does not change them)")
    print(f"{'mode':<5} {'side':<6} {'packs':>6} {'drawn':>7} {'packed':>7} {'too long':>9} {'in buffer':>10} "
          f"{'dropped':>8} {'dropped %':>10}")
    for mode in args.modes.split(","):
        theirs = bagel_counts(raw, MODES[mode], args.packs, budgets)
        ours = mmidx_counts(datasets, MODES[mode], theirs["drawn"], budgets)
        for side, counts in (("BAGEL", theirs), ("mmidx", ours)):
            share = 100 * counts["dropped"] / counts["drawn"]
            print(f"{mode:<5} {side:<6} {counts['packs']:>6} {counts['drawn']:>7} {counts['packed']:>7} "
                  f"{counts['skipped']:>9} {counts['buffered']:>10} {counts['dropped']:>8} {share:>9.1f}%",
                  flush=True)
    print("# dropped: drawn but neither packed, nor skipped as too long, nor left in the buffer at the end: lost.")
    print(f"# command: python benchmarks/bench_bagel_drops.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
