"""``mmidx export`` at scale: wall, the process tree's CPU and peak anonymous memory, and CPU per sample with its
growth per 10×, at each worker count, against another checkout's export (``--baseline``).

Each size is a synthetic t2i set (:func:`mmidx.toolkit.scale_data.write_synthetic`, one set of files, or
``--shards`` shards) with a small BPE recorded as its tokenizer, so export decodes and checks every caption as
it would a real build's. Each round runs every side once, as its own ``mmidx export`` process measured by
:func:`common.measure` (the side that goes first rotating), into a fresh folder; the outputs are then compared:
this checkout's files byte for byte across worker counts, and the baseline's by content (the same rows and
columns in every file: its row groups were whole files, so its bytes differ). A baseline past ``--timeout`` is
reported as such (its figures are then lower bounds). The line under the table says the machine's load.

    python benchmarks/bench_export.py --samples 100000,1000000 --workers 1,2 --baseline /path/to/main-checkout
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import REPO, Measured, Watch, measure

from mmidx.tokenizer import Tokenizer
from mmidx.toolkit.scale_data import write_synthetic
from mmidx.toolkit.synthetic import train_tokenizer

WORDS = ("a photo of a red car on the road at night blue sky over green hills with a small dog and two cats "
         "sitting near the old house by the river in winter").split()


def tokenizer(workdir: Path) -> Tokenizer:
    corpus = [" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 9)) for i in range(2000)]
    return Tokenizer(train_tokenizer(workdir / "tokenizer", corpus, vocab_size=600))


def side_command(checkout: Path, prefix: Path, layout: str, output: Path, workers: int | None) -> list[str]:
    """``mmidx export`` of ``checkout`` (``workers`` None: the baseline's, which has no --workers)."""
    extra = [] if workers is None else ["--workers", str(workers), "--quiet"]
    return [sys.executable, "-m", "mmidx.cli", "export", str(prefix), "--to", layout, "-o", str(output), *extra]


def digest(folder: Path) -> str:
    """One hash of every file's relative path and bytes."""
    hashed = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            hashed.update(str(path.relative_to(folder)).encode() + b"\0")
            with open(path, "rb") as stream:
                while block := stream.read(1 << 22):
                    hashed.update(block)
    return hashed.hexdigest()


def same_content(a: Path, b: Path, layout: str) -> bool:
    """Whether two exports hold the same files with the same rows (parquet: tables equal; others: bytes)."""
    if layout != "parquet":
        return digest(a) == digest(b)
    import pyarrow.parquet as pq

    names = sorted(path.name for path in a.iterdir())
    return names == sorted(path.name for path in b.iterdir()) and all(
        pq.read_table(a / name).equals(pq.read_table(b / name)) for name in names)


def run_size(samples: int, sides: dict[str, tuple[Path, int | None]], args: argparse.Namespace, workdir: Path,
             tok: Tokenizer) -> dict[str, list[Measured]]:
    prefix = workdir / f"synthetic-{samples}"
    write_synthetic(prefix, samples, shards=args.shards, tokenizer=tok)
    names, results = list(sides), {name: [] for name in sides}
    try:
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            outputs = {}
            for name in order:
                checkout, workers = sides[name]
                output = workdir / f"out-{samples}-{name.replace(' ', '-')}"
                shutil.rmtree(output, ignore_errors=True)
                env = {**os.environ, "PYTHONPATH": str(checkout)}
                result = measure(side_command(checkout, prefix, args.to, output, workers), env=env,
                                 timeout=args.timeout, cwd=workdir)  # not a checkout: -m imports PYTHONPATH's
                results[name].append(result)
                outputs[name] = output
                print(f"  {samples:>11,} {name:<12} {describe(result, samples)}", flush=True)
            mine = [name for name in names if sides[name][1] is not None and results[name][-1].returncode == 0]
            if len({digest(outputs[name]) for name in mine}) > 1:
                sys.exit(f"{samples:,} samples: this checkout's exports differ between worker counts")
            if "baseline" in results and results["baseline"][-1].returncode == 0 and mine and \
                    not same_content(outputs["baseline"], outputs[mine[0]], args.to):
                sys.exit(f"{samples:,} samples: the baseline's export holds other rows than this checkout's")
            for output in outputs.values():
                shutil.rmtree(output, ignore_errors=True)
    finally:
        for path in workdir.glob(f"synthetic-{samples}*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return results


def describe(result: Measured, samples: int) -> str:
    state = "" if result.returncode == 0 else f"  (exit {result.returncode}: past the timeout, a lower bound)" \
        if result.returncode in (-9, 137) else f"  (failed, exit {result.returncode}: {result.output[-200:]!r})"
    return (f"wall {result.wall:8.1f} s  CPU {result.cpu:8.1f} s  peak anon {result.peak_anon / 2**20:7.0f} MiB  "
            f"CPU/sample {result.cpu / samples * 1e6:6.1f} µs{state}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="100000,1000000", help="comma-separated sizes")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts of this checkout")
    parser.add_argument("--baseline", type=Path, help="another checkout (its mmidx/ with compiled kernels) to compare")
    parser.add_argument("--baseline-samples", help="sizes the baseline runs at (default: all)")
    parser.add_argument("--to", default="parquet", choices=("parquet", "wds", "hf"))
    parser.add_argument("--shards", type=int, default=1, help="shards of each synthetic set")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a side may run")
    parser.add_argument("--workdir", type=Path, help="where the sets are written (deleted after each size)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.samples.split(",")]
    baseline_sizes = set(sizes if args.baseline_samples is None else map(int, args.baseline_samples.split(",")))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-export-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(workdir)
    table: dict[int, dict[str, list[Measured]]] = {}
    print(f"mmidx export --to {args.to} of synthetic t2i sets ({args.shards} shard(s)), {args.rounds} round(s)")
    with Watch() as watch:
        for samples in sizes:
            sides = {f"workers {n}": (REPO, int(n)) for n in args.workers.split(",")}
            if args.baseline is not None and samples in baseline_sizes:
                sides = {"baseline": (args.baseline.resolve(), None), **sides}
            table[samples] = run_size(samples, sides, args, workdir, tok)
    summarise(table, sizes)
    print(watch.describe())
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


def summarise(table: dict[int, dict[str, list[Measured]]], sizes: list[int]) -> None:
    """Each side's medians per size, its CPU per sample's growth per 10×, and the baseline's wall over each side's."""
    print("\nmedians (CPU per sample includes the process's start, about half a second):")
    names = list(dict.fromkeys(name for sides in table.values() for name in sides))
    for samples, sides in table.items():
        for name, results in sides.items():
            median = Measured(statistics.median(r.wall for r in results), statistics.median(r.cpu for r in results),
                              max(r.peak_anon for r in results), max(r.returncode for r in results), "")
            print(f"  {samples:>11,} {name:<12} {describe(median, samples)}")
    for name in names:
        done = [n for n in sizes if name in table[n] and all(r.returncode == 0 for r in table[n][name])]
        for small, large in itertools.pairwise(done):
            per = [statistics.median(r.cpu for r in table[n][name]) / n for n in (small, large)]
            print(f"  {name}: CPU per sample {small:,} → {large:,}: {per[1] / per[0]:.2f}×, "
                  f"{(per[1] / per[0]) ** (1 / math.log10(large / small)):.2f}× per 10×")
    for samples, sides in table.items():
        if "baseline" in sides:
            base = statistics.median(r.wall for r in sides["baseline"])
            for name in sides:
                if name != "baseline":
                    wall = statistics.median(r.wall for r in sides[name])
                    print(f"  {samples:,}: baseline wall ÷ {name} wall = {base / wall:.2f}×"
                          f"{' (baseline past its timeout: at least)' if sides['baseline'][0].returncode else ''}")

if __name__ == "__main__":
    main()
