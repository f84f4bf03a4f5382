"""Writer throughput: mmidx's DatasetBuilder vs Megatron-Core's IndexedDatasetBuilder, fsync on both sides.

Two workloads, the same in-memory data handed to both writers in one process:

* tokens: text documents of lognormal length (uint16), one sequence each;
* captions + images: per sample a short caption and one image's encoded bytes (random bytes of a
  JPEG's size; writers do not look inside). Megatron writes them as two datasets (uint16 captions,
  uint8 image bytes), the usual way to store images with it; mmidx writes one multimodal dataset
  (plan, image table, checksums).

Megatron's builder does not fsync; its files are fsynced after ``finalize`` and that time is counted,
as mmidx's own fsyncs are. Run: ``python benchmarks/bench_write.py [--tokens N] [--images N]``.
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
from common import machine

from mmidx.builder import DatasetBuilder, Element, StoredImage


def fsync_files(*paths: str) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def megatron_write(prefix: str, items: list[np.ndarray], dtype: type) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

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
    with DatasetBuilder(prefix, kind="multimodal", vocab_size=32000) as builder:
        for caption, data in zip(captions, images, strict=True):
            builder.add_sample([caption], [StoredImage(data, 512, 512, "JPEG", "RGB")], [view])
        builder.finalize()


def timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000_000, help="tokens of the text workload")
    parser.add_argument("--images", type=int, default=5_000, help="samples of the image workload")
    parser.add_argument("--image-bytes", type=int, default=60_000, help="mean encoded size of an image")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each writer (best is reported)")
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-write")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

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
    token_bytes = int(lengths.sum()) * 2
    image_bytes = int(sizes.sum())

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    p = str(work)
    runs = {
        "tokens: Megatron IndexedDatasetBuilder": lambda: megatron_write(f"{p}/mt", documents, np.uint16),
        "tokens: mmidx DatasetBuilder": lambda: mmidx_text(f"{p}/mm", documents),
        "captions + images: Megatron (two builders)": lambda: (megatron_write(f"{p}/mc", captions, np.uint16),
                                                               megatron_write(f"{p}/mi", image_arrays, np.uint8)),
        "captions + images: mmidx DatasetBuilder": lambda: mmidx_images(f"{p}/mmi", captions, images),
    }
    best = {name: float("inf") for name in runs}
    for _ in range(args.repeats):  # interleaved, so that load from other work hits both sides alike
        for name, run in runs.items():
            best[name] = min(best[name], timed(run))
    print(f"# bench_write — {token_bytes / 1e6:.0f} MB of tokens in {len(documents):,} documents; "
          f"{image_bytes / 1e6:.0f} MB of image bytes in {args.images:,} samples; "
          f"best of {args.repeats}, fsync counted")
    print(f"# {machine('numpy', 'megatron-core')}")
    volume = {"tokens": token_bytes, "captions + images": image_bytes}
    for name, seconds in best.items():
        kind = name.split(":")[0]
        peer = best[f"{kind}: Megatron IndexedDatasetBuilder" if kind == "tokens"
                    else f"{kind}: Megatron (two builders)"]
        print(f"{name:<45} {seconds:7.3f} s  {volume[kind] / seconds / 1e9:6.2f} GB/s  "
              f"{peer / seconds:5.2f}× Megatron's throughput")


if __name__ == "__main__":
    main()
