"""``mmidx index`` at scale: the CPU, wall and peak anonymous memory of the process tree (``common.measure``) of
``mmidx index P --world-size 8 --global-batch-size 64`` (which builds the pack index under both packing policies,
bagel and tight, for the GPU-time report), on synthetic t2i sets of each size, against another checkout's
(``--baseline``, e.g. main before the chunked sizing), each side its own process with a fresh index cache, the side
that goes first alternating per size. This checkout also indexes the same samples written as a sharded set
(``--shards``), whose report must be the single set's. Every set is deleted after its size is measured.

    python benchmarks/bench_index_memory.py --samples 1000000,10000000 --baseline /path/to/main-checkout
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from common import REPO, Measured, Watch, commit, machine, measure

from mmidx.toolkit.scale_data import write_synthetic


def index_command(prefix: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", "mmidx.cli", "index", str(prefix), "--world-size", "8", "--global-batch-size",
            "64", "--cache-dir", str(cache), "--json"]


def run(checkout: Path, prefix: Path, cache: Path, timeout: float) -> Measured:
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    result = measure(index_command(prefix, cache), env=env, timeout=timeout, cwd=checkout)
    shutil.rmtree(cache, ignore_errors=True)
    return result


def report_of(result: Measured) -> str:
    """The JSON the command printed (its build time left out: only it differs between equal indices)."""
    text = result.output[result.output.find("{"):]
    return "\n".join(line for line in text.splitlines() if "build_seconds" not in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="1000000,10000000", help="comma-separated sizes")
    parser.add_argument("--shards", type=int, default=50, help="shards of the sharded set of each size")
    parser.add_argument("--baseline", type=Path, help="another checkout (its mmidx/ with compiled kernels)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a command may run")
    parser.add_argument("--workdir", type=Path, help="where the sets are written (default: a temporary folder)")
    args = parser.parse_args()
    print(machine(), f"commit {commit()}", sep="\n")
    rows = []
    with Watch() as watch:
        for turn, samples in enumerate(int(size) for size in args.samples.split(",")):
            work = Path(tempfile.mkdtemp(prefix="bench_index_", dir=args.workdir))
            try:
                single = write_synthetic(work / "single", samples)
                sides = [("this checkout", REPO, single)]
                if args.baseline is not None:
                    sides.insert(turn % 2, ("baseline", args.baseline.resolve(), single))
                results = {name: run(checkout, prefix, work / "cache", args.timeout)
                           for name, checkout, prefix in sides}
                shutil.rmtree(single.parent / "single.shards", ignore_errors=True)
                for path in work.glob("single.*"):
                    path.unlink()
                sharded = write_synthetic(work / "sharded", samples, shards=args.shards)
                results[f"this checkout, {args.shards} shards"] = run(REPO, sharded, work / "cache", args.timeout)
                equal = report_of(results[f"this checkout, {args.shards} shards"]) == report_of(
                    results["this checkout"])
                for name, result in results.items():
                    if result.returncode != 0:
                        print(f"{samples:,} {name}: exit {result.returncode}: {result.output[-400:]}")
                    rows.append((samples, name, result))
                print(f"{samples:,}: the sharded set's report {'equals' if equal else 'DIFFERS from'} the single's")
                if not equal:
                    sys.exit(1)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    print(f"{'samples':>12} {'side':<28} {'wall s':>8} {'CPU s':>8} {'CPU us/sample':>14} {'peak anon MiB':>14}")
    for samples, name, result in rows:
        print(f"{samples:>12,} {name:<28} {result.wall:>8.1f} {result.cpu:>8.1f} {result.cpu / samples * 1e6:>14.2f} "
              f"{result.peak_anon / 2**20:>14.0f}")
    print(watch.describe())


if __name__ == "__main__":
    main()
