"""mmidx.index against megatron-core, side by side on the same inputs; prints a Markdown table.

    python benchmarks/bench_index.py            # 10M documents, 10M blended / packed samples
    python benchmarks/bench_index.py --quick    # a smoke run in seconds

Every mmidx result is checked equal to Megatron's before its time is reported. Times are the best
of ``--repeat`` runs, each on one core (all kernels here are single-threaded).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from importlib.metadata import version

import numpy as np

from mmidx import index

warnings.filterwarnings("ignore")  # megatron-core warns about missing Apex / Transformer Engine
from common import best_of, machine  # noqa: E402
from megatron.core.datasets import gpt_dataset, helpers  # noqa: E402
from megatron.core.datasets.utils import normalize  # noqa: E402

SEQ_LENGTH = 4096
SEED = 1234




def assert_same(ours, theirs) -> None:
    ours = ours if isinstance(ours, tuple) else (ours,)
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), "mmidx and Megatron disagree"


def megatron_gpt_indices(sizes: np.ndarray, num_samples: int | None) -> tuple[np.ndarray, ...]:
    """GPTDataset._build_document_sample_shuffle_indices from Megatron's own functions (train split,
    add_extra_token_to_sequence=True), without its cache."""
    documents = np.arange(len(sizes), dtype=np.int32)
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs, tokens = 1, tokens_per_epoch
    if num_samples is not None:
        while tokens < num_samples * SEQ_LENGTH + 1:
            num_epochs += 1
            tokens += tokens_per_epoch
    separate_final_epoch = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // SEQ_LENGTH
        per_epoch = (tokens_per_epoch - 1) // SEQ_LENGTH
        separate_final_epoch = num_samples - sans_final < int(0.80 * per_epoch)
    state = np.random.RandomState(SEED)
    document_index = gpt_dataset._build_document_index(documents, num_epochs, state, separate_final_epoch)
    sample_index = helpers.build_sample_idx(sizes, document_index, SEQ_LENGTH, num_epochs, tokens_per_epoch)
    total = sample_index.shape[0] - 1
    first_range = sans_final if separate_final_epoch else total
    shuffle_index = gpt_dataset._build_shuffle_index(first_range, total, state)
    return document_index, sample_index, shuffle_index


def megatron_blend(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        dataset_index, dataset_sample_index, normalize(list(weights)), len(weights), size, False
    )
    return dataset_index, dataset_sample_index




def _installed(name: str) -> bool:
    try:
        version(name)
    except Exception:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=10_000_000, help="documents, ~1000 tokens on average")
    parser.add_argument("--samples", type=int, default=10_000_000, help="blended and packed samples")
    parser.add_argument("--quick", action="store_true", help="200K documents and 1M samples: a smoke run")
    parser.add_argument("--repeat", type=int, default=1, help="runs per measurement; the best is reported")
    args = parser.parse_args()
    if args.quick:
        args.docs, args.samples = 200_000, 1_000_000

    rng = np.random.default_rng(0)
    # lognormal with sigma 1 has mean exp(mu + 1/2): mu = ln(1000) - 1/2 gives ~1000 tokens.
    sizes = np.maximum(rng.lognormal(np.log(1000) - 0.5, 1.0, args.docs), 1).astype(np.int32)
    tokens_per_epoch = int(sizes.sum())
    samples_per_epoch = (tokens_per_epoch - 1) // SEQ_LENGTH
    rows: list[tuple[str, float | None, float]] = []

    def compare(name: str, ours: Callable[[], object], theirs: Callable[[], object]) -> None:
        their_time, their_result = best_of(theirs, args.repeat)
        our_time, our_result = best_of(ours, args.repeat)
        assert_same(our_result, their_result)
        rows.append((name, their_time, our_time))
        print(f"  {name}: Megatron {their_time:.3f} s, mmidx {our_time:.3f} s", flush=True)

    docs = f"{args.docs / 1e6:g}M docs"
    for epochs in (1, 3):
        document_index = index.build_document_index(
            np.arange(args.docs, dtype=np.int32), epochs, np.random.RandomState(SEED), False
        )
        arguments = (sizes, document_index, SEQ_LENGTH, epochs, tokens_per_epoch)
        compare(
            f"sample_idx kernel, {docs}, {epochs} epoch(s)",
            lambda a=arguments: index.build_sample_index(*a),
            lambda a=arguments: helpers.build_sample_idx(*a),
        )
    for epochs, num_samples in ((1, None), (3, int(2.9 * samples_per_epoch))):
        compare(
            f"document+sample+shuffle index, {docs}, {epochs} epoch(s)",
            lambda n=num_samples: index.gpt_indices(sizes, seq_length=SEQ_LENGTH, num_samples=n, seed=SEED),
            lambda n=num_samples: megatron_gpt_indices(sizes, n),
        )

    def shuffled(shuffle: Callable[[np.random.RandomState, np.ndarray], None]) -> np.ndarray:
        array = np.arange(args.docs, dtype=np.int32)
        shuffle(np.random.RandomState(SEED), array)
        return array

    compare(
        f"RandomState.shuffle, {docs} int32",
        lambda: shuffled(index.legacy_shuffle),
        lambda: shuffled(lambda state, array: state.shuffle(array)),
    )

    samples = f"{args.samples / 1e6:g}M samples"
    for num_datasets in (2, 10, 100):
        weights = np.random.default_rng(num_datasets).random(num_datasets) + 0.01
        compare(
            f"blending, {samples}, {num_datasets} datasets",
            lambda w=weights: index.blending_indices(w, args.samples),
            lambda w=weights: megatron_blend(w, args.samples),
        )

    # A t2i / edit / vlm mix, ~1100 / ~5000 / ~1500 tokens a sample, with BAGEL's budgets.
    group_sizes, weights = [4_000_000, 1_000_000, 2_000_000], [0.5, 0.2, 0.3]
    stream_time, (groups, _, _) = best_of(
        lambda: index.multimodal_stream(group_sizes, weights, args.samples, SEED), args.repeat
    )
    rows.append((f"multimodal_stream, {samples}, 3 groups", None, stream_time))
    means = np.array([1100, 5000, 1500])
    counts = np.maximum(rng.normal(means[groups], 0.3 * means[groups]), 1).astype(np.int64)
    pack_time, packed = best_of(
        lambda: index.pack_samples(counts, groups, mandatory=[False] * 3), args.repeat
    )
    rows.append((f"pack_samples, {samples}, BAGEL budgets", None, pack_time))

    print(f"\nMachine: {machine('numpy', 'megatron-core', 'Cython')}\n")
    print("| operation | Megatron (s) | mmidx (s) | mmidx / Megatron |")
    print("|---|---:|---:|---:|")
    for name, theirs, ours in rows:
        if theirs is None:
            print(f"| {name} | – | {ours:.3f} | – |")
        else:
            print(f"| {name} | {theirs:.3f} | {ours:.3f} | {ours / theirs:.2f} |")
    stats = packed.stats
    print(
        f"\npacking: {stats['num_packs']} packs, fill {stats['fill_vs_max']:.3f} of max, "
        f"{stats['fill_vs_expected']:.3f} of expected, {stats['deferred']} deferred, "
        f"max deferral {stats['max_deferral']} packs, {stats['solo_packs']} solo packs, "
        f"{args.samples / pack_time / 1e6:.0f}M samples/s"
    )


if __name__ == "__main__":
    main()
