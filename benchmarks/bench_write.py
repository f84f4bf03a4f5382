"""Writer throughput: mmidx's DatasetBuilder vs Megatron-Core's IndexedDatasetBuilder, fsync on both sides.

Two workloads, the same in-memory data handed to both writers in one process:

* tokens: text documents of lognormal length (uint16), one sequence each;
* captions + images: per sample a short caption and one image's encoded bytes (random bytes of a
  JPEG's size; writers do not look inside). Megatron writes them as two datasets (uint16 captions,
  uint8 image bytes), the usual way to store images with it; mmidx writes one multimodal dataset
  (plan, image table, checksums).

Megatron's builder does not fsync; its files are fsynced after ``finalize`` and that time is counted,
as mmidx's own fsyncs are. Every run writes files that do not exist yet, after a sync, and is timed on the
wall clock (a write's cost is mostly the kernel's: copying into the page cache, writeback, fsync). The protocol
is benchmarks/common.py's: each round runs the writers of a workload in turn, the first side rotating; the
table gives each side's best and median and mmidx's throughput over Megatron's in every round (median and
spread), then the commit, the load and the other processes' cores; the headline is withheld when the run was
noisy. ``--control`` adds Megatron against itself each round: the spread the machine alone gives a ratio.
Whole builds (tokenizing included) against Megatron's ``preprocess_data.py`` are ``bench_build.py``.

Run: ``python benchmarks/bench_write.py --control`` (the README's figures, ~1 minute) or ``--quick``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from common import Watch, interleave, machine, ratio
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from mmidx.ingest.writer import DatasetBuilder
from mmidx.sources.elements import Element, StoredImage


def fsync_files(*paths: str) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def megatron_write(prefix: str, items: list[np.ndarray], dtype: type) -> None:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for item in items:
        builder.add_item(torch.from_numpy(item))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    fsync_files(f"{prefix}.bin", f"{prefix}.idx")


def mmidx_text(prefix: str, documents: list[np.ndarray]) -> None:
    with DatasetBuilder(prefix, kind="text", vocab_size=32000) as builder:
        for document in documents:
            builder.add_document([document])
        builder.finalize()


def mmidx_images(prefix: str, captions: list[np.ndarray], images: list[bytes]) -> None:
    view = [Element("text", 0), Element("vae_image", 0, loss=True)]
    # random bytes standing for images, stored unchecked: the write path is timed, as Megatron's builder's
    with DatasetBuilder(prefix, kind="multimodal", vocab_size=32000, check_images=False) as builder:
        for caption, data in zip(captions, images, strict=True):
            builder.add_sample([caption], [StoredImage(data, 512, 512, "JPEG", "RGB")], [view])
        builder.finalize()


def fresh_run(prefix: str, function, *args) -> float:
    """Seconds of one write into files that do not exist yet, the disk idle before it starts.

    The previous run's files are deleted and everything is synced before the clock starts, so neither
    writer pays for the other's writeback or for freeing old blocks, nor truncates a file it rewrites
    (ext4 starts writing a truncated-and-rewritten file back when it is closed, which a rerun into the
    same name would get and a first build would not).
    """
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*"):
        path.unlink()
    os.sync()
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000_000, help="tokens of the text workload")
    parser.add_argument("--images", type=int, default=5_000, help="samples of the image workload")
    parser.add_argument("--image-bytes", type=int, default=60_000, help="mean encoded size of an image")
    parser.add_argument("--repeats", type=int, default=7, help="rounds; each round runs both writers of a workload")
    parser.add_argument("--control", action="store_true",
                        help="also run Megatron against itself each round: the spread the load alone causes")
    parser.add_argument("--quick", action="store_true", help="10M tokens, 1,000 images, 3 rounds")
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-write")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.quick:
        args.tokens, args.images, args.repeats = 10_000_000, 1_000, 3

    rng = np.random.default_rng(0)
    mean = 1000
    lengths = np.maximum(1, rng.lognormal(np.log(mean) - 0.5, 1.0, args.tokens // mean)).astype(np.int64)
    documents = [rng.integers(0, 32000, n, dtype=np.uint16) for n in lengths]
    captions = [rng.integers(0, 32000, n, dtype=np.uint16) for n in rng.integers(10, 60, args.images)]
    sizes = rng.integers(args.image_bytes // 2, args.image_bytes * 3 // 2, args.images)
    blob = rng.integers(0, 256, int(sizes.max()) * 2, dtype=np.uint8).tobytes()
    offsets = rng.integers(0, int(sizes.max()), args.images)
    images = [blob[o:o + s] for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)]
    image_arrays = [np.frombuffer(data, dtype=np.uint8) for data in images]
    volume = {"tokens": int(lengths.sum()) * 2, "captions + images": int(sizes.sum())}

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    p = str(work)
    workloads = {  # workload: (Megatron's run, mmidx's run), each returning its seconds
        "tokens": (lambda: fresh_run(f"{p}/mt", megatron_write, f"{p}/mt", documents, np.uint16),
                   lambda: fresh_run(f"{p}/mm", mmidx_text, f"{p}/mm", documents)),
        "captions + images": (lambda: fresh_run(f"{p}/mc", megatron_write, f"{p}/mc", captions, np.uint16)
                              + fresh_run(f"{p}/mi", megatron_write, f"{p}/mi", image_arrays, np.uint8),
                              lambda: fresh_run(f"{p}/mmi", mmidx_images, f"{p}/mmi", captions, images)),
    }
    sides = ["Megatron", "mmidx"] + (["Megatron again"] if args.control else [])
    writer = {"Megatron": 0, "mmidx": 1, "Megatron again": 0}  # which run of a workload each side is
    seconds = {kind: {side: [] for side in sides} for kind in workloads}
    with Watch() as watch:
        for kind, runs in workloads.items():  # interleave orders the turns; each run times its own write
            interleave({side: (lambda _, times=seconds[kind][side], run=runs[writer[side]]: times.append(run()))
                        for side in sides}, [None], args.repeats)
    shutil.rmtree(work, ignore_errors=True)
    print(f"# bench_write — {volume['tokens'] / 1e6:.0f} MB of tokens in {len(documents):,} documents; "
          f"{volume['captions + images'] / 1e6:.0f} MB of image bytes in {args.images:,} samples; "
          f"{args.repeats} rounds, the writers in turn, fsync counted, wall clock")
    print(f"# {machine('numpy', 'megatron-core')}")
    print("| workload | Megatron best / median s | mmidx best / median s | mmidx GB/s, median | "
          "mmidx throughput ÷ Megatron's per round: median (spread) |")
    print("|---|---:|---:|---:|---:|")
    for kind, runs in seconds.items():
        megatron, mmidx = runs["Megatron"], runs["mmidx"]
        print(f"| {kind} | {min(megatron):.3f} / {np.median(megatron):.3f} | {min(mmidx):.3f} / "
              f"{np.median(mmidx):.3f} | {volume[kind] / np.median(mmidx) / 1e9:.2f} | {ratio(megatron, mmidx)} |")
        if args.control:  # what the load alone does to a ratio: Megatron against itself
            print(f"| {kind}, Megatron against itself | | | | {ratio(megatron, runs['Megatron again'])} |")
    print("\nPer round, mmidx throughput ÷ Megatron's: " + "; ".join(
        f"{kind} " + " ".join(f"{a / b:.2f}" for a, b in zip(runs["Megatron"], runs["mmidx"], strict=True))
        for kind, runs in seconds.items()))
    print(f"\n{watch.describe()}")
    for kind, runs in seconds.items():
        print(f"Headline, {kind}: " + watch.headline(f"{ratio(runs['Megatron'], runs['mmidx'])} Megatron's "
                                                     "throughput"))


if __name__ == "__main__":
    main()
