"""The data cache's eviction by next use (Belady) against LRU, and the GET request rate ranks send to S3.

Hit rates (bytes read from the cache over bytes read) at limits of 25, 50, 75 and 100% of the dataset over
3 epochs:

* simulated (``--simulate``, default): a large t2i / edit / vlm mix, BAGEL's packing, its pack index built by
  mmidx's own kernels over a synthetic table (as bench_index.py --scale), each sample's bytes laid out in an
  images file and a tokens file with JPEG-like sizes; the blocks of the packs one node's ranks train on
  (``--node-ranks`` of a ``--world``, one pack a rank a step) replayed in order through the cache's own
  eviction (mmidx.read.next_use.simulate, the same keep_nearest as the cache) and through LRU;
* measured (``--moto``): a t2i dataset on moto's S3 server, 3 epochs through the loader (2 workers) with the
  cache at half the dataset, by next use and as LRU (the same cache without the schedule), beside the
  simulation of the same trace.

Request rate (with ``--simulate``): the GETs per pack of the large mix, computed from its pack index (one per
coalesced range, as the prefetcher sends them; with the cache, one per run of neighbouring missing blocks, from
the simulation at each limit), and what 64 and 512 ranks training one pack a ``--step-seconds`` would send per
second, against S3's 5,500 GETs a second per prefix (each dataset under its own prefix).

    python benchmarks/bench_cache.py                # the simulation and the request rates (a few minutes)
    python benchmarks/bench_cache.py --world 64     # one node of 8 ranks in a job of 64: its share of the packs
    python benchmarks/bench_cache.py --moto         # the measured case (minutes)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import Watch, machine

from mmidx.io.cache_folder import BLOCK_SIZE, entry_bytes
from mmidx.read.next_use import STEP, block_uses, simulate
from mmidx.read.prefetch import coalesce

# A large mix: (name, samples, mean tokens a sample, images a sample, mean kB an image, text bytes a sample)
MIX = (("t2i", 120_000, 1100, 1, 300, 400), ("edit", 30_000, 5000, 2, 400, 300), ("vlm", 60_000, 1500, 1, 150, 2000))
LIMITS = (0.25, 0.5, 0.75, 1.0)
EPOCHS = 3
S3_GETS_PER_PREFIX = 5_500


def large_mix(folder: str) -> tuple[object, dict, dict]:
    """The mix's pack index over 3 epochs, its byte layout (``ranges_of``) and each file's size."""
    from mmidx.config import DataConfig, GroupConfig
    from mmidx.index.cache import cached_build
    from mmidx.index.pack_index import PackIndex, write_pack_index
    from mmidx.index.stream import ViewTable

    rng = np.random.default_rng(0)
    offsets, tokens, layout = [], [], {}
    for name, samples, mean, images, kilobytes, text in MIX:
        offsets.append(np.arange(samples + 1))
        tokens.append(np.maximum(rng.normal(mean, 0.3 * mean, samples), 1).astype(np.int64))
        image_bytes = rng.lognormal(np.log(kilobytes * 1000) - 0.125, 0.5, (samples, images)).astype(np.int64).sum(1)
        text_bytes = np.maximum(rng.normal(text, 0.3 * text, samples), 4).astype(np.int64)
        layout[name] = {role: np.concatenate([[0], np.cumsum(sizes)]) for role, sizes in
                        (("images", image_bytes), ("bin", text_bytes))}
    total = sum(samples for _, samples, *_ in MIX)
    config = DataConfig(groups=tuple(GroupConfig(name, (name,), samples / total) for name, samples, *_ in MIX))
    table = ViewTable.of(offsets, tokens)
    arrays, stats, path, _ = cached_build(folder, {"bench_cache": EPOCHS, "mix": MIX},
                                          lambda sink: write_pack_index(sink, table, config, EPOCHS * total))
    index = PackIndex(config, arrays, stats, table.group_base, path)
    names = [name for name, *_ in MIX]

    def ranges_of(group: int, dataset: int, samples: np.ndarray) -> dict:
        where = layout[names[group]]
        return {(names[group], role): (ends[samples], ends[samples + 1], np.arange(len(samples)))
                for role, ends in where.items()}

    sizes = {(name, role): int(ends[-1]) for name, where in layout.items() for role, ends in where.items()}
    return index, ranges_of, sizes


def requests_per_pack(index, ranges_of, packs: np.ndarray) -> dict[str, float]:
    """Mean GETs per pack without a cache (one per coalesced range of each file), in all and per dataset."""
    counts: dict[str, int] = {}
    for pack in packs.tolist():
        by_group: dict[int, list[int]] = {}
        for item in index.items(pack):
            by_group.setdefault(item.group, []).append(item.sample)
        for group, samples in by_group.items():
            for (name, _), (starts, stops, _) in ranges_of(group, 0, np.array(samples)).items():
                counts[name] = counts.get(name, 0) + len(coalesce(list(zip(starts.tolist(), stops.tolist(),
                                                                           strict=True))))
    return {name: count / len(packs) for name, count in counts.items()}


def simulate_table(args: argparse.Namespace) -> None:
    folder = tempfile.mkdtemp(prefix="mmidx-bench-cache-")
    with Watch() as watch:
        start = time.perf_counter()
        index, ranges_of, sizes = large_mix(folder)
        world, ranks = args.world, args.node_ranks

        def node_packs(step: int) -> list[int]:  # one pack per rank a step; this node's ranks are the first ones
            return [step * world + rank for rank in range(ranks)]

        steps = range(len(index) // world)
        uses = block_uses(index, steps, node_packs, ranges_of, BLOCK_SIZE)
        built = time.perf_counter() - start
        cached = sum(int(entry_bytes(size, BLOCK_SIZE, np.arange(-(-size // BLOCK_SIZE))).sum())
                     for size in sizes.values())  # the whole dataset, as the cache would hold it
        reads = sum(len(found) for found in uses.values())
        distinct = sum(len(np.unique(found // STEP)) for found in uses.values())
        rows = []
        for fraction in LIMITS:
            limit = int(fraction * cached)
            found = {policy: simulate(uses, sizes, BLOCK_SIZE, limit, policy) for policy in ("next-use", "lru")}
            rows.append((fraction, limit, found))
        sample = np.random.default_rng(1).choice(len(index), min(2_000, len(index)), replace=False)
        gets = requests_per_pack(index, ranges_of, sample)
    print(f"machine: {machine()}")
    print(f"mix: {', '.join(f'{name} {n:,} samples ({k} images of ~{kb} kB)' for name, n, _, k, kb, _ in MIX)}; "
          f"{EPOCHS} epochs = {len(index):,} packs (BAGEL's packing); {sum(sizes.values()) / 1e9:.1f} GB in "
          f"{distinct:,} blocks of {BLOCK_SIZE >> 20} MiB read ({cached / 1e9:.1f} GB as cached); {reads:,} block "
          f"reads by one node of {ranks} ranks in a world of {world}; pack index and uses built in {built:.0f} s")
    best = 1 - distinct / reads
    print("\n| limit (of the dataset as cached) | hit rate, next use (Belady) | hit rate, LRU | GETs/pack, next use "
          "| GETs/pack, LRU |")
    print("|---|---:|---:|---:|---:|")
    for fraction, limit, found in rows:
        belady, lru = found["next-use"], found["lru"]
        print(f"| {fraction:.0%} ({limit / 1e9:.1f} GB) | {belady['hit_rate']:.1%} | {lru['hit_rate']:.1%} | "
              f"{belady['gets'] / len(steps) / ranks:.1f} | {lru['gets'] / len(steps) / ranks:.1f} |")
    print(f"(every block's first read is a miss: no policy hits more than {best:.1%} of block reads here)")
    per_pack = sum(gets.values())
    print(f"\nGETs per pack without the cache (one per coalesced range, mean of {len(sample):,} packs): "
          + ", ".join(f"{name} {value:.1f}" for name, value in gets.items()) + f"; {per_pack:.1f} in all")
    print(f"\n| ranks (one pack each per {args.step_seconds:g} s) | GETs/s, all | GETs/s, busiest prefix | vs S3's "
          f"{S3_GETS_PER_PREFIX:,}/s a prefix |")
    print("|---|---:|---:|---|")
    for ranks in (64, 512):
        rate = ranks / args.step_seconds
        busiest = max(gets.values()) * rate
        verdict = "under" if busiest <= S3_GETS_PER_PREFIX else f"over ({busiest / S3_GETS_PER_PREFIX:.1f}×)"
        print(f"| {ranks} | {per_pack * rate:,.0f} | {busiest:,.0f} | {verdict} |")
    print(f"# {watch.describe()}")


def moto_case(args: argparse.Namespace) -> None:
    import logging

    import boto3
    from bench_remote import loader_of, upload, write_dataset
    from moto.server import ThreadedMotoServer

    from mmidx.io.block_store import NEVER
    from mmidx.io.cache_folder import create, read_state
    from mmidx.read import next_use
    from mmidx.read.prefetch import PackPrefetcher

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    folder = Path(tempfile.mkdtemp(prefix="mmidx-bench-cache-"))
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}", MMIDX_CACHE_DIR=str(folder / "small"))
    boto3.client("s3").create_bucket(Bucket="bench")
    write_dataset(folder / "t2i", args.samples)
    upload(boto3.client("s3"), folder / "t2i", "data/t2i")
    packs = args.samples * EPOCHS // 40  # bench_remote's loader: about 40 samples a pack
    loader = loader_of("s3://bench/data/t2i", packs, args.workers, True)
    dataset = loader.dataset
    sizes = {file.key[:2]: file.size for file in dataset.builder.datasets[0][0].remote_files.values()}
    uses = block_uses(dataset.packs, range(len(dataset.packs)), lambda step: [step],
                      PackPrefetcher(dataset.packs, dataset.builder.datasets).ranges, args.block_size)
    cached = sum(int(entry_bytes(size, args.block_size, np.arange(-(-size // args.block_size))).sum())
                 for size in sizes.values())
    limit = cached // 2
    rows = {}
    with Watch() as watch:
        for policy in ("next-use", "lru"):
            cache = folder / policy
            create(cache, args.block_size)
            os.environ.update(MMIDX_CACHE_DIR=str(cache), MMIDX_CACHE_LIMIT=str(limit))
            if policy == "lru":  # the same cache without the schedule: every block's next use unknown
                next_use.NextUse.next_use = lambda self, key, blocks, pack: np.full(len(blocks), NEVER)
            count = sum(1 for _ in loader_of("s3://bench/data/t2i", packs, args.workers, True))
            run = read_state(cache / "data")["run"]
            measured = run["bytes_from_cache"] / (run["bytes_from_cache"] + run["bytes_fetched"])
            rows[policy] = (measured, simulate(uses, sizes, args.block_size, limit, policy)["hit_rate"], count)
    server.stop()
    print(f"machine: {machine()}")
    print(f"t2i on moto: {args.samples} samples, {sum(sizes.values()) / 1e6:.1f} MB; {EPOCHS} epochs = "
          f"{rows['lru'][2]} packs, {args.workers} workers; blocks of {args.block_size:,} bytes; limit "
          f"{limit:,} bytes (half the dataset as cached)")
    print("\n| eviction | hit rate, measured (bytes) | hit rate, simulated |")
    print("|---|---:|---:|")
    for policy, (measured, simulated, _) in rows.items():
        print(f"| {'next use (Belady)' if policy == 'next-use' else 'LRU'} | {measured:.1%} | {simulated:.1%} |")
    print(f"# {watch.describe()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moto", action="store_true", help="the measured case on moto instead of the simulation")
    parser.add_argument("--step-seconds", type=float, default=1.0,
                        help="seconds a rank takes per pack (a training micro-step), for the request rate")
    parser.add_argument("--world", type=int, default=8, help="ranks of the job, each training one pack a step")
    parser.add_argument("--node-ranks", type=int, default=8, help="ranks on the node whose cache is simulated")
    parser.add_argument("--samples", type=int, default=300, help="--moto: samples in the dataset")
    parser.add_argument("--workers", type=int, default=2, help="--moto: loader workers")
    parser.add_argument("--block-size", type=int, default=64 << 10, help="--moto: the cache's block")
    args = parser.parse_args()
    (moto_case if args.moto else simulate_table)(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
