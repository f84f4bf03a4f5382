"""Every mmidx command at scale: CPU seconds, wall seconds and the process tree's peak anonymous memory, at each size,
with the growth per 10× and the extrapolation to 10^9 samples.

Each size is a synthetic t2i set written directly (:func:`mmidx.toolkit.scale_data.write_synthetic`: tiny real PNGs,
captions of a small BPE, no encoding or tokenizing), sharded as a build of that size ends (one shard per
``--unit`` samples, 20,000 being a parquet build's work unit); ``--many-shards K`` adds a set of K shards. Every
command runs as its own process, measured by :func:`common.measure` (``wait4``'s CPU of the whole tree, ``RssAnon``
summed over the live tree, polled; mapped files are not anonymous memory):

======================  =========================================================================================
build's end             the table over the finished shards (what a build past 64 units ends by: ``write_sharded``)
merge                   ``mmidx merge P -o Q``: one Megatron-compatible set of files (deleted after)
index                   ``mmidx index P --world-size 8 --global-batch-size 64``: the pack index (cached for the
                        loader below) and both policies' fill and balance at world 8
inspect                 ``mmidx inspect P``
verify                  ``mmidx verify P`` (``--verify-args``: e.g. ``--workers 2``)
export                  ``mmidx export P --to parquet`` (``--export-args``: e.g. ``--workers 2``; deleted after)
viewer                  ``mmidx view P``: the first answer of the overview, a grid, a sample page, the packs and a
                        pack (each page's seconds are in the JSON; the row's wall is the whole probe's)
random access           10^5 ``ds[i]`` at random positions, each reading its texts and images, twice (the
                        first pass opens and checks each shard it meets)
PackLoader              a fresh process: the config, the cached pack index and the first batch's ``to_dict()``
======================  =========================================================================================

The set is written once per size and deleted after. ``--skip CMD@SIZE`` leaves out a command at a size (say why in
the published table: e.g. export at 10^8 takes hours on 2 cores). ``--json`` writes every figure. The line under the
table says the machine's load; run it on a quiet machine.

    python benchmarks/bench_scale.py --samples 1000000,10000000,100000000 --many-shards 50000 --json scale.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_export import tokenizer as small_tokenizer
from common import Measured, Watch, measure

from mmidx import format as fmt
from mmidx.toolkit.scale_data import write_synthetic

COMMANDS = ("build's end", "merge", "index", "inspect", "verify", "export", "viewer", "random access", "PackLoader")
READS = 100_000
PAGE_TIMEOUT = 120.0  # seconds the viewer probe waits for a page
RANDOM_ACCESS = """
import random, sys, time
from mmidx import MMIDXDataset
ds = MMIDXDataset(sys.argv[1])
positions = random.Random(0).choices(range(len(ds)), k=int(sys.argv[2]))
per_read = []
for _ in range(2):  # the first pass opens and checks each shard it meets; the second meets them again
    started = time.perf_counter()
    for i in positions:
        sample = ds[i]
        sample.texts, sample.images
    per_read.append((time.perf_counter() - started) / len(positions) * 1e6)
print(f"{per_read[0]:.2f} us per read, first pass; {per_read[1]:.2f} us, second")
"""
FIRST_BATCH = """
import sys, time
from mmidx import PackBuilder, PackDataset, PackLoader, build_pack_index
from mmidx.config import config_for
started = time.perf_counter()
config = config_for([sys.argv[1]])
index = build_pack_index(config, cache_dir=sys.argv[2], progress=False)
loader = PackLoader(PackDataset(index, PackBuilder(config)), global_batch_size=1, rank=0, world_size=1)
data = next(iter(loader)).to_dict()
print(f"first batch after {time.perf_counter() - started:.2f} s: {data['sequence_length']} tokens, "
      f"index reused: {index.reused}")
"""
BUILD_END = """
import sys
from mmidx.ingest.sharded import write_sharded
write_sharded(sys.argv[1], list(range(int(sys.argv[2]))), {"source": "t2i"})
"""


def mmidx(*args: str) -> list[str]:
    return [sys.executable, "-m", "mmidx.cli", *args]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def probe_viewer(prefix: str) -> None:
    """Serve ``prefix`` with ``mmidx view`` and print, as JSON, the seconds each page took to answer (its first
    answer, whatever it says: a page that is still being computed answers that it is) and its status."""
    import httpx

    port = free_port()
    server = subprocess.Popen(mmidx("view", prefix, "--port", str(port)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    base, pages = f"http://127.0.0.1:{port}", {}
    try:
        started = time.perf_counter()
        while True:  # the server's start, then its first overview
            try:
                answer = httpx.get(base + "/", timeout=PAGE_TIMEOUT)
                break
            except httpx.TransportError:
                if time.perf_counter() - started > PAGE_TIMEOUT or server.poll() is not None:
                    raise SystemExit("the viewer did not start") from None
                time.sleep(0.05)
        pages["start + overview"] = (time.perf_counter() - started, answer.status_code)
        name = Path(prefix).name
        length = fmt.read_metadata(fmt.file_path(prefix, "meta"))["counts"]["samples"]
        for label, path in (("overview", "/"), ("grid", f"/dataset/{name}"),
                            ("sample", f"/dataset/{name}/sample/{random.Random(1).randrange(length)}"),
                            ("packs", "/packs"), ("pack", "/pack/0")):
            began = time.perf_counter()
            answer = httpx.get(base + path, timeout=PAGE_TIMEOUT)
            pages[label] = (time.perf_counter() - began, answer.status_code)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(json.dumps(pages))
    if failed := [label for label, (_, status) in pages.items() if status != 200]:
        raise SystemExit(f"pages that did not answer 200: {', '.join(failed)}")


def commands(prefix: Path, shards: int, work: Path, args: argparse.Namespace) -> dict[str, list[str]]:
    here = Path(__file__)
    return {
        "build's end": [sys.executable, "-c", BUILD_END, str(prefix), str(shards)],
        "merge": mmidx("merge", str(prefix), "-o", str(work / "merged")),
        "index": mmidx("index", str(prefix), "--world-size", "8", "--global-batch-size", "64",
                       "--cache-dir", str(work / "cache")),
        "inspect": mmidx("inspect", str(prefix)),
        "verify": mmidx("verify", str(prefix), *args.verify_args.split()),
        "export": mmidx("export", str(prefix), "--to", "parquet", "-o", str(work / "export"),
                        *args.export_args.split()),
        "viewer": [sys.executable, str(here), "--probe-viewer", str(prefix)],
        "random access": [sys.executable, "-c", RANDOM_ACCESS, str(prefix), str(READS)],
        "PackLoader": [sys.executable, "-c", FIRST_BATCH, str(prefix), str(work / "cache")],
    }


def run_size(label: str, samples: int, shards: int, args: argparse.Namespace, work: Path,
             tok: object) -> dict[str, Measured]:
    """Write the set, run every command on it (in COMMANDS' order: the loader uses the index's cache), delete it."""
    prefix = work / "set"
    started = time.perf_counter()
    write_synthetic(prefix, samples, shards=shards, tokenizer=tok)
    print(f"{label}: {samples:,} samples in {shards:,} shards, written in {time.perf_counter() - started:.1f} s",
          flush=True)
    results = {}
    try:
        for name, argv in commands(prefix, shards, work, args).items():
            if f"{name}@{samples}" in args.skip or name in args.skip:
                continue
            result = measure(argv, timeout=args.timeout, env={**os.environ, "MMIDX_CACHE_DIR": str(work / "cache")})
            results[name] = result
            print(f"  {name:<14} {describe(result, samples)}", flush=True)
            for output in ("merged", "export"):
                for path in work.glob(f"{output}*"):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
    finally:
        for path in work.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return results


def describe(result: Measured, samples: int) -> str:
    last = result.output.strip().splitlines()[-1:] or [""]
    state = "" if result.returncode == 0 else f"  FAILED (exit {result.returncode})"
    return (f"CPU {result.cpu:9.1f} s  wall {result.wall:9.1f} s  peak anon {result.peak_anon / 2**20:7.0f} MiB  "
            f"CPU/sample {result.cpu / samples * 1e6:8.2f} µs{state}  | {last[0][:100]}")


def growth(small: tuple[int, Measured], large: tuple[int, Measured]) -> tuple[float, float]:
    """CPU per sample's and peak memory's growth per 10× from ``small`` to ``large`` (samples, measured)."""
    (n, a), (m, b) = small, large
    decades = math.log10(m / n)
    cpu = (b.cpu / m) / (a.cpu / n)
    return cpu ** (1 / decades), (b.peak_anon / max(a.peak_anon, 1)) ** (1 / decades)


def table(rows: dict[int, dict[str, Measured]]) -> str:
    """The published table: per command and size its figures; per command the growth per 10× over the last
    decade measured and the extrapolation to 10^9 (CPU-hours on one core, memory)."""
    sizes = sorted(rows)
    lines = ["| command | " + " | ".join(f"{n:.0e} CPU-s / wall-s / anon MiB" for n in sizes)
             + " | CPU/sample growth per 10× | memory growth per 10× | at 10^9 (on paper) |",
             "|---|" + "---|" * len(sizes) + "---|---|---|"]
    for name in COMMANDS:
        cells = [f"{r.cpu:.1f} / {r.wall:.1f} / {r.peak_anon / 2**20:.0f}" + ("" if r.returncode == 0 else " FAILED")
                 if (r := rows[n].get(name)) else "not run" for n in sizes]
        have = [(n, rows[n][name]) for n in sizes if name in rows[n] and rows[n][name].returncode == 0]
        if len(have) >= 2:
            cpu, memory = growth(have[-2], have[-1])
            n, last = have[-1]
            decades = math.log10(1e9 / n)
            hours = last.cpu * 1e9 / n * cpu ** decades / 3600
            gib = last.peak_anon * memory ** decades / 2**30
            extra = [f"{cpu:.2f}×", f"{memory:.2f}×", f"{hours:,.1f} CPU-h, {gib:.2f} GiB"]
        else:
            extra = ["", "", ""]
        lines.append(f"| {name} | " + " | ".join(cells + extra) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="1000000,10000000", help="comma-separated sizes")
    parser.add_argument("--unit", type=int, default=20_000, help="samples per shard (a build's work unit)")
    parser.add_argument("--many-shards", type=int, default=0, help="also a set of this many shards")
    parser.add_argument("--many-shards-samples", type=int, default=1_000_000, help="that set's samples")
    parser.add_argument("--verify-args", default="", help="extra arguments of verify (e.g. '--workers 2')")
    parser.add_argument("--export-args", default="--quiet", help="extra arguments of export")
    parser.add_argument("--skip", action="append", default=[], help="CMD or CMD@SIZE to leave out (repeatable)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a command may run")
    parser.add_argument("--workdir", type=Path, help="where the sets are written (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--probe-viewer", metavar="PREFIX", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe_viewer:
        return probe_viewer(args.probe_viewer)
    root = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.workdir))
    tok = small_tokenizer(root)
    runs = [(f"{int(n):,}", int(n), max(1, int(n) // args.unit)) for n in args.samples.split(",")]
    if args.many_shards:
        runs.append((f"{args.many_shards:,} shards", args.many_shards_samples, args.many_shards))
    rows, shards_rows, report = {}, {}, []
    try:
        with Watch() as watch:
            for label, samples, shards in runs:
                work = root / "work"
                work.mkdir()
                results = run_size(label, samples, shards, args, work, tok)
                (shards_rows if label.endswith("shards") else rows)[samples] = results
                report.append({"label": label, "samples": samples, "shards": shards,
                               "commands": {name: {"cpu_s": r.cpu, "wall_s": r.wall, "peak_anon_bytes": r.peak_anon,
                                                   "returncode": r.returncode, "output_tail": r.output[-2000:]}
                                            for name, r in results.items()}})
                work.rmdir()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(rows))
    if shards_rows:
        print()
        print(table(shards_rows).replace("CPU-s", "samples in many shards, CPU-s"))
    print()
    print(watch.describe())
    if args.json:
        args.json.write_text(json.dumps({"runs": report, "load": watch.describe()}, indent=1))
    if any(r.returncode for results in [*rows.values(), *shards_rows.values()] for r in results.values()):
        sys.exit("a command failed (FAILED above)")


if __name__ == "__main__":
    main()
