"""Bytes fetched twice by a cold data cache: each block fetched once by a process's threads, against every thread
fetching what it misses.

bench_remote.py's mix and setting (its t2i dataset on moto's S3 server on 127.0.0.1, behind its proxy adding
``--delay-ms`` to each request; the prefetching ``PackLoader`` with ``--workers`` workers, each fetching its next
packs on 8 threads; the cache cold, with room for the whole dataset, so nothing is evicted) read through the cache
in two ways, in turn, ``--rounds`` times (the first side rotating):

* before: every thread fetches the blocks it misses (``Fetching`` made to claim every block for every thread,
  as the cache did before a second reader waited for the fetch in flight);
* after: the cache as it is (:class:`mmidx.io.kept_blocks.Fetching`).

Per side and round: the bytes fetched (the run's ``bytes_fetched`` in ``state.json``, every worker's), the bytes
of the distinct blocks stored (each block of the dataset at most once), and the duplicate bytes, their
difference. Loader workers are forked, so the patch of the "before" side reaches them.

    python benchmarks/bench_fetch_once.py --packs 20 --workers 2 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench_remote import DelayProxy, loader_of, measure, reading_through, upload, write_dataset
from common import Watch, machine


@contextlib.contextmanager
def side(name: str) -> Iterator[None]:
    """``before``: every thread fetches what it misses (no fetch is waited for); ``after``: the cache as it is."""
    from mmidx.io.kept_blocks import Fetching

    saved = Fetching.claim, Fetching.release
    if name == "before":
        Fetching.claim = lambda self, sha, role, blocks: (list(blocks), [])
        Fetching.release = lambda self, sha, role, fetched: None
    try:
        yield
    finally:
        Fetching.claim, Fetching.release = saved


def stored_bytes(data: Path) -> int:
    """The bytes of the distinct blocks the cache folder ``data`` holds (each entry's payload, header aside)."""
    from mmidx.io.cache_folder import HEADER

    return sum(path.stat().st_size - HEADER for path in data.glob("*/*/*") if path.name.isdigit())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=20, help="packs read per side and round")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="added to every request")
    parser.add_argument("--samples", type=int, default=600, help="samples in the dataset")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=64 << 10, help="the data cache's block (bench_remote's)")
    args = parser.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    from mmidx.io.cache_admin import clear_cache
    from mmidx.io.cache_folder import create, read_state

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = DelayProxy(server.get_host_and_port(), args.delay_ms / 1000)
    folder = Path(tempfile.mkdtemp(prefix="mmidx-bench-fetch-once-"))
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}", MMIDX_CACHE_DIR=str(folder / "cache"))
    client = boto3.client("s3")
    client.create_bucket(Bucket="bench")
    write_dataset(folder / "t2i", args.samples)
    upload(client, folder / "t2i", "data/t2i")
    data_bytes = sum(path.stat().st_size for path in folder.glob("t2i.*") if path.suffix in (".bin", ".images"))
    limits = {"cold": 4 * data_bytes + (16 << 20)}
    figures: dict[str, list[tuple[int, int]]] = {"before": [], "after": []}  # (fetched, distinct stored)
    with Watch() as watch:
        for round_ in range(args.rounds):
            for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
                clear_cache(folder / "cache-cold")
                create(folder / "cache-cold", args.block_size)
                with side(name), reading_through(folder, "cold", limits):
                    measure(loader_of("s3://bench/data/t2i", args.packs + 1, args.workers, True), args.packs)
                data = folder / "cache-cold" / "data"
                figures[name].append((read_state(data)["run"]["bytes_fetched"], stored_bytes(data)))
    print(f"machine: {machine()}")
    print(f"dataset: {args.samples} samples, .bin and .images {data_bytes / 1e6:.1f} MB; {args.delay_ms:g} ms a "
          f"request; {args.workers} workers; {args.packs + 1} packs per side and round, {args.rounds} rounds; blocks "
          f"of {args.block_size:,} bytes, a cold cache with room for the dataset")
    print(f"{'side':<8}{'round':>6}{'bytes fetched':>16}{'distinct':>14}{'duplicate':>14}{'duplicate share':>17}")
    for name, rows in figures.items():
        for number, (fetched, distinct) in enumerate(rows):
            print(f"{name:<8}{number:>6}{fetched:>16,}{distinct:>14,}{fetched - distinct:>14,}"
                  f"{(fetched - distinct) / max(fetched, 1):>17.1%}")
    for name, rows in figures.items():
        print(f"{name}: median duplicate bytes {statistics.median(f - d for f, d in rows):,.0f} of a median "
              f"{statistics.median(f for f, _ in rows):,.0f} fetched")
    print(f"# {watch.describe()}")
    server.stop()


if __name__ == "__main__":
    main()
