"""Random and sequential reads: mmidx vs Megatron-Core's IndexedDataset on the same files.

Builds (once, cached under --workdir) a text dataset of lognormal document lengths with mmidx's
builder, then opens the same .idx/.bin pair with both readers and measures, in one process:

* random single reads of a text document: Megatron's ``get(i)`` against ``get_tokens(i)``,
  ``tokens.get(i)`` and a sample's ``ds[i].text(0)``, with a raw ``numpy.memmap`` slice at precomputed
  pointers as the physical floor;
* a random caption + image sample (``ds[i].text(0)`` and ``ds[i].image(0)``, bytes plus probed size) of
  a multimodal dataset against two Megatron gets (captions and image bytes stored as two datasets);
* a gather of 1024 random documents into one array: mmidx's one call vs Megatron's per-document loop
  plus ``numpy.concatenate``;
* a sequential scan of the whole token stream in blocks of consecutive documents (GB/s): mmidx's gather
  vs Megatron's slice read, with a plain memmap copy as the floor.

The protocol is benchmarks/common.py's: the sides take turns chunk by chunk (1000 random reads, the same
indices on every side), the first side rotating, over ``--rounds`` rounds; each table gives each side's CPU
time a read (median over rounds) and its ratio to Megatron's per round (median and spread), then the
commit, the load and the other processes' cores during it; headlines are withheld when the run was noisy.

Run: ``python benchmarks/bench_read.py`` (the README's figures; ~2 minutes after a first build of ~1 GB
of files) or ``--quick`` (seconds). The files are in the page cache after the first pass, so this measures
the readers, not the disk.
"""

from __future__ import annotations

import argparse
import itertools
import warnings
from pathlib import Path

import numpy as np
import torch
from common import Watch, interleave, machine, ratio

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
    # random bytes standing for images, stored unchecked: reads of stored bytes are timed, not decodes
    with DatasetBuilder(prefix, kind="multimodal", vocab_size=32000, check_images=False) as builder:
        for caption, image in zip(captions, images, strict=True):
            builder.add_sample([caption], [StoredImage(image.tobytes(), 512, 512, "JPEG", "RGB")], [view])
        builder.finalize()


def chunks(indices: np.ndarray, size: int) -> list[list[int]]:
    """The indices as lists of ``size``: one turn of a side reads a whole chunk, so the clock's own cost
    (a microsecond a reading) is paid once per chunk, not once per read."""
    return [indices[k:k + size].tolist() for k in range(0, len(indices), size)]


def reader(function):
    """A side that calls ``function(i)`` for every index of a chunk."""
    def side(chunk):
        for i in chunk:
            function(i)
    return side


def table(title: str, sides: dict, items: list, rounds: int, per_item: float, unit: str, peer: str,
          headlines: dict[str, str]) -> None:
    """Interleave the sides over ``items`` for ``rounds`` rounds under a Watch and print one Markdown table:
    each side's CPU time per unit (``per_item`` units an item; the median over rounds) and its ratio to
    ``peer`` per round (median, spread). ``headlines``: side name -> headline label, printed through
    ``Watch.headline``."""
    with Watch() as watch:
        turns = interleave(sides, items, rounds)
    units = per_item * len(items)
    print(f"\n**{title}** ({len(items)} turns a side a round, {rounds} rounds, sides interleaved)\n")
    print(f"| side | CPU µs {unit}, median over rounds | ÷ {peer}, per round: median (spread) |")
    print("|---|---:|---:|")
    for name in sides:
        seconds = turns.per_round(name)
        versus = "" if name == peer else str(ratio(seconds, turns.per_round(peer)))
        print(f"| {name} | {np.median(seconds) / units * 1e6:.3f} | {versus} |")
    print(f"\n{watch.describe()}")
    for name, label in headlines.items():
        print(f"Headline, {label}: " + watch.headline(f"{ratio(turns.per_round(name), turns.per_round(peer))} "
                                                      f"{peer}'s CPU time"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--mean-tokens", type=int, default=1000)
    parser.add_argument("--reads", type=int, default=50_000, help="random reads a side a round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--image-samples", type=int, default=5_000, help="samples of the caption + image dataset")
    parser.add_argument("--quick", action="store_true", help="20K documents, 1K image samples, 5K reads, 3 rounds")
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-read")
    args = parser.parse_args()
    if args.quick:
        args.documents, args.image_samples, args.reads, args.rounds = 20_000, 1_000, 5_000, 3

    warnings.filterwarnings("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = Path(args.workdir) / f"text-{args.documents}-{args.mean_tokens}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    build_corpus(prefix, args.documents, args.mean_tokens)
    ours = MMIDXDataset(prefix)
    theirs = IndexedDataset(str(prefix))
    raw = np.asarray(np.memmap(f"{prefix}.bin", dtype=np.uint16, mode="r"))  # a plain ndarray over the map
    starts = (ours.tokens.sequence_pointers // 2).tolist()  # Python ints: the floor pays no numpy scalar
    ends = (ours.tokens.sequence_pointers // 2 + ours.tokens.sequence_lengths).tolist()
    total_bytes = len(raw) * 2
    for _ in range(2):  # warm the page cache
        np.array(raw).sum()
    print(f"# bench_read — {args.documents:,} documents, mean {args.mean_tokens} tokens, "
          f"{total_bytes / 1e9:.2f} GB of uint16 tokens; {args.image_samples:,} caption + image samples; "
          f"{args.reads:,} random reads a side a round")
    print(f"# {machine('numpy', 'megatron-core')}")

    rng = np.random.default_rng(1)
    indices = rng.integers(0, len(ours.tokens), args.reads)
    for i in indices[:1000].tolist():
        assert np.array_equal(ours.get_tokens(i), theirs.get(i)) and np.array_equal(ours[i].text(0), theirs.get(i))
    reads = chunks(indices, 1000)
    table("Random single read of a text document", {
        "Megatron IndexedDataset.get(i)": reader(theirs.get),
        "mmidx MMIDXDataset.get_tokens(i)": reader(ours.get_tokens),
        "mmidx TokenStream.get(i)": reader(ours.tokens.get),
        "mmidx ds[i].text(0)": reader(lambda i: ours[i].text(0)),
        "raw memmap slice at known pointers (floor)": reader(lambda i: raw[starts[i]:ends[i]]),
    }, reads, args.rounds, 1000, "a read", "Megatron IndexedDataset.get(i)",
        {"mmidx ds[i].text(0)": "text sample ds[i].text(0)", "mmidx MMIDXDataset.get_tokens(i)": "get_tokens(i)"})

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
    table("Random caption + image sample (20–100 KB of image bytes; Megatron stores them as two datasets)", {
        "Megatron captions.get(i) + images.get(i)": reader(megatron_pair),
        "mmidx ds[i].text(0) + ds[i].image(0)": reader(mmidx_pair),
        "mmidx ds[i].image(0) alone (bytes view + probed size, format, mode)": reader(lambda i: mm[i].image(0)),
    }, chunks(picks, 1000), args.rounds, 1000, "a sample", "Megatron captions.get(i) + images.get(i)",
        {"mmidx ds[i].text(0) + ds[i].image(0)": "caption + image sample ds[i]"})

    batch = [row for row in rng.integers(0, len(ours.tokens), (max(8, args.reads // 1000), 1024))]
    assert np.array_equal(ours.gather(batch[0])[0], np.concatenate([theirs.get(int(i)) for i in batch[0]]))
    table("Gather of 1024 random documents into one array", {
        "Megatron get loop + numpy.concatenate": lambda row: np.concatenate([theirs.get(int(i)) for i in row]),
        "mmidx gather (one call)": ours.gather,
    }, batch, args.rounds, 1, "a gather", "Megatron get loop + numpy.concatenate",
        {"mmidx gather (one call)": "gather of 1024 documents"})

    block = 4096
    bounds = [*range(0, len(ours.tokens), block), len(ours.tokens)]
    blocks = list(itertools.pairwise(bounds))
    with Watch() as watch:
        turns = interleave({
            "Megatron slice reads ds[a:b]": lambda ab: theirs[ab[0]:ab[1]],
            "mmidx gather of the block": lambda ab: ours.gather(np.arange(ab[0], ab[1])),
            "raw memmap copy (floor)": lambda ab: np.array(raw[starts[ab[0]]:ends[ab[1] - 1]]),
        }, blocks, args.rounds)
    print(f"\n**Sequential scan of the whole token stream** (blocks of {block} documents, each side in turn on "
          f"each block, {args.rounds} rounds)\n")
    print("| side | GB/s (of CPU time), median over rounds | ÷ Megatron's CPU time, per round: median (spread) |")
    print("|---|---:|---:|")
    for name in turns.cpu:
        seconds = turns.per_round(name)
        peer = turns.per_round("Megatron slice reads ds[a:b]")
        versus = "" if seconds == peer else str(ratio(seconds, peer))
        print(f"| {name} | {total_bytes / np.median(seconds) / 1e9:.2f} | {versus} |")
    print(f"\n{watch.describe()}")


if __name__ == "__main__":
    main()
