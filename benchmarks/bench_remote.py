"""Packs per second from object storage: naive per-sample range reads vs the prefetching reader vs local files.

Starts moto's S3 server on 127.0.0.1 and, in front of it, a small TCP proxy (written here) that
holds every HTTP request ``--delay-ms`` (20 ms) before passing it on, as a distant store would,
and counts the data requests (GETs of ``.bin``/``.images``). Writes a t2i-like dataset (captions
and JPEGs, under 10 MB per file: moto's cost per request grows with object size), uploads it, and
times three readers side by side in one run, each a ``PackLoader`` with ``--workers`` workers:

* local: the files on disk (the peer);
* naive: the same dataset from ``s3://`` read with one ranged request per read, no prefetch;
* prefetch: from ``s3://`` with mmidx's reader, which fetches each worker's next packs ahead;
* cache, cold / warm / half: the prefetching reader through the node's data cache (mmidx.io.block_cache): an
  empty cache each round; a cache that holds the dataset (filled once before the rounds); a limit of half the
  dataset, kept across rounds (its first round starts empty).

The cache's blocks are ``--block-size`` (64 KiB): a scale model of 1 MiB blocks over a real dataset, a block
holding about six of these 11 kB images as a 1 MiB block holds six 170 kB ones, so a cold read fetches what a
cold read of a large dataset fetches per image, not the whole (7 MB) dataset in its first pack.

The readers take turns, ``--rounds`` times (the first reader rotating), so that load on a shared machine
hits them alike; each reader's rate is the median over rounds, and its ratio to local files the median of
the per-round ratios, with their range. The load, and the cores other processes used, are printed under the
table, whose ratios are withheld when other processes used more than half a core (benchmarks/common.py).
Beside the rates, the CPU each reader cost per pack handed out (median over rounds; the first, untimed pack,
the workers' start and the packs they built ahead included): the loader workers' (where packs are built and
the cache is read), and this process's, which holds the trainer's loop but also the S3 server and the proxy:
what a remote reader makes the store spend on the same cores shows, and CPU is less distorted by load than rates.

    python benchmarks/bench_remote.py --packs 20 --workers 2 --delay-ms 20
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from common import Watch, machine, ratio

METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")


class DelayProxy:
    """TCP proxy on 127.0.0.1: each HTTP request from a client waits ``delay`` seconds before it is
    forwarded (per connection, so concurrent requests wait concurrently); counts data GETs."""

    def __init__(self, target: tuple[str, int], delay: float):
        self.target, self.delay = target, delay
        self.data_requests = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            server = socket.create_connection(self.target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        try:
            while chunk := source.recv(1 << 16):
                if requests and chunk.startswith(METHODS):
                    line = chunk.split(b"\r\n", 1)[0]
                    if line.startswith(b"GET ") and (b".bin" in line or b".images" in line):
                        with self._lock:
                            self.data_requests += 1
                    time.sleep(self.delay)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def write_dataset(prefix: Path, samples: int, seed: int = 0) -> None:
    """A t2i-like dataset: a caption and a 160-320 px JPEG per sample (a few MB in all)."""
    from mmidx.ingest.writer import DatasetBuilder
    from mmidx.sources.elements import Element, StoredImage
    from mmidx.toolkit.synthetic import photo_jpeg

    rng, pick = np.random.default_rng(seed), random.Random(seed)
    special = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4}
    with DatasetBuilder(prefix, vocab_size=1000, special_tokens=special) as builder:
        for _ in range(samples):
            width, height = pick.randrange(160, 320), pick.randrange(160, 320)
            image = StoredImage(photo_jpeg(pick, width, height, 85), width, height, "JPEG", "RGB")
            builder.add_sample([rng.integers(10, 1000, rng.integers(20, 80)).tolist()], [image],
                               [[Element("text", 0, enable_cfg=True), Element("vae_image", 0, loss=True)]])
        builder.finalize()


def upload(client, prefix: Path, key: str) -> None:
    from mmidx.read.dataset import dataset_files

    for path in dataset_files(prefix):
        client.upload_file(str(path), "bench", key + path.name[len(prefix.name):])


def loader_of(prefix: str, packs: int, workers: int, prefetch: bool):
    from mmidx.config import ModelGeometry, config_for
    from mmidx.index.pack_index import build_pack_index
    from mmidx.pack.builder import PackBuilder
    from mmidx.train.loader import PackDataset, PackLoader

    class NaiveDataset(PackDataset):
        """Each read is its own ranged request: what a reader without the known order does."""

        def __getitem__(self, index: int):
            return self.builder.build(index, self.packs.items(index))

    config = config_for([prefix], geometry=ModelGeometry(max_latent_size=64))  # BAGEL's VAE sizes (512-1024 px)
    index = build_pack_index(config, num_samples=packs * 40)
    dataset = (PackDataset if prefetch else NaiveDataset)(index, PackBuilder(config))
    return PackLoader(dataset, global_batch_size=1, num_workers=workers)


def reading_through(folder: Path, cache: str | None, limits: dict[str, int]):
    """Readers opened in the block read through the data cache ``cache`` ("cold", "warm", "half"; None: none),
    as ``--cache-dir`` and ``--cache-limit`` make every reader of a command do (MMIDX_CACHE_DIR/LIMIT)."""
    from mmidx.cli.common import cache_options

    given = {"cache_dir": None, "cache_limit": None} if cache is None else \
        {"cache_dir": str(folder / f"cache-{cache}"), "cache_limit": limits[cache]}
    return cache_options(argparse.Namespace(**given))


def measure(loader, packs: int) -> tuple[float, int]:
    """Packs per second after the first pack (worker start-up aside), and the packs timed."""
    batches = iter(loader)
    next(batches)
    start, count = time.perf_counter(), 0
    for _ in batches:
        count += 1
        if count == packs:
            break
    return count / (time.perf_counter() - start), count


def children_seconds() -> float:
    """CPU seconds of this process's children that have ended (the loaders' workers)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=40, help="packs timed per reader")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="added to every request")
    parser.add_argument("--samples", type=int, default=600, help="samples in the dataset")
    parser.add_argument("--rounds", type=int, default=3, help="each reader timed once per round, in turn")
    parser.add_argument("--block-size", type=int, default=64 << 10, help="the data cache's block (see above)")
    args = parser.parse_args()

    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    from mmidx.io.cache_admin import clear_cache
    from mmidx.io.cache_folder import create

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = DelayProxy(server.get_host_and_port(), args.delay_ms / 1000)
    folder = Path(tempfile.mkdtemp(prefix="mmidx-bench-remote-"))
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}", MMIDX_CACHE_DIR=str(folder / "cache"))
    client = boto3.client("s3")
    client.create_bucket(Bucket="bench")
    write_dataset(folder / "t2i", args.samples)
    upload(client, folder / "t2i", "data/t2i")
    sizes = {path.name: path.stat().st_size for path in folder.glob("t2i.*")}

    readers = [("local files", str(folder / "t2i"), True, None),
               ("s3, naive range reads", "s3://bench/data/t2i", False, None),
               ("s3, prefetching", "s3://bench/data/t2i", True, None),
               ("s3, cache cold", "s3://bench/data/t2i", True, "cold"),
               ("s3, cache warm", "s3://bench/data/t2i", True, "warm"),
               ("s3, cache half", "s3://bench/data/t2i", True, "half")]
    data_bytes = sizes["t2i.bin"] + sizes["t2i.images"]
    limits = {"cold": 4 * data_bytes + (16 << 20), "warm": 4 * data_bytes + (16 << 20), "half": data_bytes // 2}
    for kind in limits:
        create(folder / f"cache-{kind}", args.block_size)
    with reading_through(folder, "warm", limits):  # filled before the rounds
        measure(loader_of("s3://bench/data/t2i", args.packs + 1, args.workers, True), args.packs)
    rates: dict[str, list[float]] = {name: [] for name, *_ in readers}
    requests: dict[str, list[float]] = {name: [] for name, *_ in readers}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in readers}  # (workers, this process)
    with Watch() as watch:
        for round_ in range(args.rounds):  # in turn, the first reader rotating
            shift = round_ % len(readers)
            for name, prefix, prefetch, cache in readers[shift:] + readers[:shift]:
                if cache == "cold":
                    clear_cache(folder / "cache-cold")
                    create(folder / "cache-cold", args.block_size)
                spent = children_seconds(), time.process_time()
                with reading_through(folder, cache, limits):
                    loader = loader_of(prefix, args.packs + 1, args.workers, prefetch)
                    before = proxy.data_requests
                    rate, count = measure(loader, args.packs)  # its workers are joined when it returns
                rates[name].append(rate)
                requests[name].append((proxy.data_requests - before) / (count + 1))
                cpu[name].append(((children_seconds() - spent[0]) / (count + 1),
                                  (time.process_time() - spent[1]) / (count + 1)))
    local = rates["local files"]
    print(f"machine: {machine()}")
    print(f"dataset: {args.samples} samples, " + ", ".join(f"{n} {s / 1e6:.1f} MB" for n, s in sorted(sizes.items()))
          + f"; {args.delay_ms:g} ms added per request; {args.workers} workers; {args.packs} packs timed per reader "
          f"and round, {args.rounds} rounds; cache blocks of {args.block_size:,} bytes, half = a limit of "
          f"{limits['half']:,} bytes")
    print(f"{'reader':<24}{'packs/s, median':>16}{'× local files, median (range)':>40}{'data requests/pack':>20}"
          f"{'CPU ms/pack: workers':>22}{'this process':>14}")
    for name, *_ in readers:
        workers, own = (statistics.median(spent[side] for spent in cpu[name]) * 1e3 for side in (0, 1))
        print(f"{name:<24}{statistics.median(rates[name]):>16.2f}"
              f"{watch.headline(str(ratio(rates[name], local))):>40}{max(requests[name]):>20.1f}"
              f"{workers:>22.1f}{own:>14.1f}")
    print(f"# {watch.describe()}")
    server.stop()


if __name__ == "__main__":
    main()
