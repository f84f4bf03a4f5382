"""Random and sequential reads: mmidx vs Megatron-Core's IndexedDataset on the same files.

Builds (once, cached under --workdir) a text dataset of lognormal document lengths with mmidx's
builder, then opens the same .idx/.bin pair with both readers and measures, in one process:

* single random read: per-call latency of ``get`` on random documents (median and p99), with a
  raw ``numpy.memmap`` slice at precomputed pointers as the physical floor;
* per-sample reads, the sides taking turns on each index: ``ds[i].text(0)`` of a text document
  against Megatron's ``get(i)``, and a caption + image (``ds[i].text(0)`` and ``ds[i].image(0)``,
  bytes plus probed size) of a multimodal dataset against two Megatron gets (captions and image
  bytes stored as two datasets);
* batch gather of 1024 random documents into one array: mmidx's one Cython call vs Megatron's
  per-document loop plus ``numpy.concatenate``;
* sequential scan of the whole token stream in blocks of consecutive documents (GB/s): mmidx's
  gather vs Megatron's slice read, with a plain memmap copy as the floor.

Run: ``python benchmarks/bench_read.py [--documents N] [--mean-tokens M]``. The files are in the page
cache after the first pass, so this measures the readers, not the disk.
"""

from __future__ import annotations

import argparse
import itertools
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from common import best_of, machine

from mmidx.ingest.writer import DatasetBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources.elements import Element, StoredImage


def build_corpus(prefix: Path, documents: int, mean_tokens: int, seed: int = 0) -> None:
    if Path(f"{prefix}.meta.json").exists():
        return
    rng = np.random.default_rng(seed)
    sigma = 1.0
    lengths = np.maximum(1, rng.lognormal(np.log(mean_tokens) - sigma**2 / 2, sigma, documents)).astype(np.int64)
    with DatasetBuilder(prefix, kind="text", vocab_size=32000) as builder:
        for length in lengths:
            builder.add_document([rng.integers(0, 32000, length, dtype=np.uint16)])
        builder.finalize()


def build_captioned_images(prefix: Path, samples: int, seed: int = 0) -> None:
    """The same captions and image bytes as one mmidx dataset and as two Megatron datasets."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if Path(f"{prefix}.meta.json").exists():
        return
    rng = np.random.default_rng(seed)
    captions = [rng.integers(0, 32000, n, dtype=np.uint16) for n in rng.integers(10, 60, samples)]
    images = [rng.integers(0, 256, n, dtype=np.uint8) for n in rng.integers(20_000, 100_000, samples)]
    for suffix, items, dtype in (("captions", captions, np.uint16), ("image-bytes", images, np.uint8)):
        builder = IndexedDatasetBuilder(f"{prefix}-{suffix}.bin", dtype=dtype)
        for item in items:
            builder.add_item(torch.from_numpy(item))
            builder.end_document()
        builder.finalize(f"{prefix}-{suffix}.idx")
    view = [Element("text", 0), Element("vae_image", 0, loss=True)]
    with DatasetBuilder(prefix, kind="multimodal", vocab_size=32000) as builder:
        for caption, image in zip(captions, images, strict=True):
            builder.add_sample([caption], [StoredImage(image.tobytes(), 512, 512, "JPEG", "RGB")], [view])
        builder.finalize()


def latencies(function, indices: np.ndarray) -> np.ndarray:
    """Per-call wall time in nanoseconds."""
    return paired_latencies([function], indices)[0]


def paired_latencies(functions, indices: np.ndarray) -> list[np.ndarray]:
    """Per-call wall time in nanoseconds of each function, taking turns on every index, so that load
    from other work on the machine falls on all of them alike."""
    clock = time.perf_counter_ns
    out = [np.empty(len(indices), dtype=np.int64) for _ in functions]
    for k, i in enumerate(indices.tolist()):
        for function, times in zip(functions, out, strict=True):
            start = clock()
            function(i)
            times[k] = clock() - start
    return out






def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--mean-tokens", type=int, default=1000)
    parser.add_argument("--reads", type=int, default=100_000, help="random single reads to time")
    parser.add_argument("--image-samples", type=int, default=20_000, help="samples of the caption + image dataset")
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-read")
    args = parser.parse_args()

    warnings.filterwarnings("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = Path(args.workdir) / f"text-{args.documents}-{args.mean_tokens}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    build_corpus(prefix, args.documents, args.mean_tokens)
    ours = MMIDXDataset(prefix)
    theirs = IndexedDataset(str(prefix))
    raw = np.memmap(f"{prefix}.bin", dtype=np.uint16, mode="r")
    starts = (ours.tokens.sequence_pointers // 2).copy()
    ends = starts + ours.tokens.sequence_lengths
    total_bytes = len(raw) * 2
    for _ in range(2):  # warm the page cache and both readers
        np.array(raw).sum()

    rng = np.random.default_rng(1)
    indices = rng.integers(0, len(ours.tokens), args.reads)
    rows = []

    floor = latencies(lambda i: raw[starts[i]:ends[i]], indices)
    megatron_get = latencies(theirs.get, indices)
    ours_get = latencies(ours.get_tokens, indices)
    ours_stream = latencies(ours.tokens.get, indices)
    for i in indices[:1000].tolist():
        assert np.array_equal(ours.get_tokens(i), theirs.get(i))
    for name, values in (("raw memmap slice (floor)", floor), ("Megatron IndexedDataset.get", megatron_get),
                         ("mmidx MMIDXDataset.get_tokens", ours_get), ("mmidx TokenStream.get", ours_stream)):
        rows.append((f"random get: {name}", f"median {np.median(values) / 1e3:.2f} µs",
                     f"p99 {np.percentile(values, 99) / 1e3:.2f} µs",
                     f"{np.median(values) / np.median(megatron_get):.2f}× Megatron"))

    def sample_text(i):
        return ours[i].text(0)

    for i in indices[:1000].tolist():
        assert np.array_equal(sample_text(i), theirs.get(i))
    text_rows = tuple(zip(("Megatron IndexedDataset.get(i)", "mmidx ds[i].text(0)"),
                          paired_latencies([theirs.get, sample_text], indices), strict=True))

    pictures = Path(args.workdir) / f"captioned-{args.image_samples}"
    build_captioned_images(pictures, args.image_samples)
    mm = MMIDXDataset(pictures)
    captions, image_bytes = IndexedDataset(f"{pictures}-captions"), IndexedDataset(f"{pictures}-image-bytes")
    np.array(np.frombuffer(mm.image_bytes, np.uint8)).sum()  # warm the page cache

    def megatron_pair(i):
        return captions.get(i), image_bytes.get(i)

    def mmidx_pair(i):
        sample = mm[i]
        return sample.text(0), sample.image(0)

    picks = rng.integers(0, len(mm), args.reads)
    for i in picks[:1000].tolist():
        (text, image), (caption, data) = mmidx_pair(i), megatron_pair(i)
        assert np.array_equal(text, caption) and bytes(image.data) == data.tobytes()
    pair_rows = tuple(zip(("Megatron captions.get(i) + images.get(i)", "mmidx ds[i].text(0) + ds[i].image(0)",
                           "mmidx ds[i].image(0) alone"),
                          paired_latencies([megatron_pair, mmidx_pair, lambda i: mm[i].image(0)], picks), strict=True))
    for label, group in (("text document", text_rows), ("caption + image", pair_rows)):
        peer = group[0][1]
        for name, values in group:
            rows.append((f"per sample, {label}: {name}", f"median {np.median(values) / 1e3:.2f} µs",
                         f"p99 {np.percentile(values, 99) / 1e3:.2f} µs",
                         f"{np.median(values) / np.median(peer):.2f}× Megatron"))

    batch = rng.integers(0, len(ours.tokens), (50, 1024))

    def megatron_batch():
        for row in batch:
            np.concatenate([theirs.get(int(i)) for i in row])

    def ours_batch():
        for row in batch:
            ours.gather(row)

    assert np.array_equal(ours.gather(batch[0])[0], np.concatenate([theirs.get(int(i)) for i in batch[0]]))
    t_megatron = best_of(megatron_batch, 3)[0] / len(batch)
    t_ours = best_of(ours_batch, 3)[0] / len(batch)
    rows.append(("gather 1024 random docs: Megatron loop + concatenate", f"{t_megatron * 1e3:.2f} ms", "", "1.00×"))
    rows.append(("gather 1024 random docs: mmidx gather (one call)", f"{t_ours * 1e3:.2f} ms", "",
                 f"{t_megatron / t_ours:.1f}× faster"))

    block = 4096
    bounds = [*list(range(0, len(ours.tokens), block)), len(ours.tokens)]

    def scan_floor():
        for a, b in itertools.pairwise(bounds):
            np.array(raw[starts[a]:ends[b - 1]])

    def scan_megatron():
        for a, b in itertools.pairwise(bounds):
            theirs[a:b]

    def scan_ours():
        for a, b in itertools.pairwise(bounds):
            ours.gather(np.arange(a, b))

    for name, function in (("raw memmap copy (floor)", scan_floor), ("Megatron slice reads", scan_megatron),
                           ("mmidx gather", scan_ours)):
        seconds, _ = best_of(function, 2)
        rows.append((f"sequential scan: {name}", f"{total_bytes / seconds / 1e9:.2f} GB/s", "", ""))

    print(f"# bench_read — {args.documents:,} documents, mean {args.mean_tokens} tokens, "
          f"{total_bytes / 1e9:.2f} GB of uint16 tokens")
    print(f"# {machine('numpy', 'megatron-core')}")
    width = max(len(row[0]) for row in rows)
    for row in rows:
        print(f"{row[0]:<{width}}  {row[1]:>16}  {row[2]:>16}  {row[3]}")


if __name__ == "__main__":
    main()
