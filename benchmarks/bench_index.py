"""mmidx.index against megatron-core, side by side on the same inputs; prints a Markdown table.

    python benchmarks/bench_index.py            # 10M documents, 10M blended / packed samples (~3 minutes)
    python benchmarks/bench_index.py --quick    # a smoke run in seconds
    python benchmarks/bench_index.py --scale    # the pack index at 10^7 and 10^8 samples (--billion: 10^9 too)
    python benchmarks/bench_index.py --scale --schedule --sizes 100000000   # plain vs a 3-phase schedule
    python benchmarks/bench_index.py --scale --schedule --mandatory          # and with a mandatory group

The README's figures are the first command's. Every mmidx result is checked equal to Megatron's. The protocol
is benchmarks/common.py's: each row runs Megatron and mmidx in turn, the first side rotating, for ``--rounds``
rounds; the table gives each side's median CPU seconds and the ratio of every round (median and spread), then
the commit, the load and the other processes' cores; the headline is withheld when the run was noisy.

"GPT indices from the files" is the whole pipeline a trainer pays once per dataset and configuration: Megatron's
``IndexedDataset`` opened and its real ``GPTDataset`` built (document, sample and shuffle index, saved to its
cache), against ``mmidx.train.gpt.GPTTextDataset`` on the same ``.idx`` (opened, its structure checked in
O(n), the same three arrays built and written to its cache). Both caches start empty. The ``.bin`` is a sparse
file of the right size: no index reads a token. Under the table: what the O(n) structure check inside that
pipeline costs (one pass of C, csrc/_structure.pyx) next to its vectorised reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from importlib.metadata import version

import numpy as np

from mmidx.config import PhaseConfig
from mmidx.index.blend import blending_indices
from mmidx.index.gpt import build_document_index, build_sample_index, gpt_indices, legacy_shuffle
from mmidx.index.packer import pack_samples
from mmidx.index.stream import ViewTable, multimodal_stream, stream_views

warnings.filterwarnings("ignore")  # megatron-core warns about missing Apex / Transformer Engine
from common import Watch, best_of, interleave, machine, ratio  # noqa: E402
from megatron.core.datasets import gpt_dataset, helpers  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.core.datasets.utils import Split, normalize  # noqa: E402

from mmidx import format as fmt  # noqa: E402
from mmidx.read.dataset import MMIDXDataset  # noqa: E402
from mmidx.read.invariants import structure_problems, vectorised_problems  # noqa: E402
from mmidx.train.gpt import GPTTextDataset  # noqa: E402

SEQ_LENGTH = 4096
SEED = 1234
# A t2i / edit / vlm mix (samples, mean tokens a view, views a sample), with BAGEL's budgets.
SCALE_GROUPS = (("t2i", 4_000_000, 1100, 2), ("edit", 1_000_000, 5000, 1), ("vlm", 2_000_000, 1500, 1))
SCALE_WEIGHTS = (0.5, 0.2, 0.3)


def scale_schedule(num_samples: int) -> tuple[PhaseConfig, ...]:
    """A 3-phase schedule over the scale mix (~2,000 tokens a sample, ~17 samples a pack): the first phase
    ends after about a third of the packs, the second (no edit group) after about two thirds of the tokens."""
    names = [name for name, *_ in SCALE_GROUPS]
    return (PhaseConfig(tuple(zip(names, SCALE_WEIGHTS, strict=True)), until_packs=max(num_samples // 50, 1)),
            PhaseConfig(tuple(zip(names, (1.0, 0.0, 1.0), strict=True)), until_tokens=num_samples * 4000 // 3),
            PhaseConfig(tuple(zip(names, (0.2, 0.5, 0.3), strict=True))))



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


def scale_run(num_samples: int, folder: str, whole: bool, schedule: bool = False,
              mandatory: bool = False) -> dict[str, float]:
    """One pack-index build in this (fresh, single-core) process: wall time, peak RSS, cache size,
    and items(k) on the result; ``whole`` times the in-memory whole-array pipeline instead; ``schedule``
    builds the 3-phase schedule of ``scale_schedule``, ``mandatory`` with its edit group ``is_mandatory``
    (its lookahead restarts at each phase, and ends in the phase without it)."""
    from mmidx.config import DataConfig, GroupConfig
    from mmidx.index.cache import cached_build
    from mmidx.index.pack_index import PackIndex, write_pack_index

    rng = np.random.default_rng(0)
    offsets, tokens = [], []
    for _, samples, mean, views in SCALE_GROUPS:
        per_sample = rng.integers(1, views + 1, samples)
        offsets.append(np.concatenate([[0], np.cumsum(per_sample)]))
        tokens.append(np.maximum(rng.normal(mean, 0.3 * mean, per_sample.sum()), 1).astype(np.int64))
    table = ViewTable.of(offsets, tokens)
    config = DataConfig(groups=tuple(GroupConfig(name, (name,), weight, is_mandatory=mandatory and name == "edit")
                                     for (name, *_), weight in zip(SCALE_GROUPS, SCALE_WEIGHTS, strict=True)),
                        schedule=scale_schedule(num_samples) if schedule else ())
    del offsets, tokens
    before = _rss_now()
    start, cpu = time.perf_counter(), time.process_time()
    if whole:
        groups, samples, epochs = multimodal_stream(np.diff(table.group_base), [0.5, 0.2, 0.3], num_samples, 0)
        sizes = [table.view_offsets[table.group_base[g]:table.group_base[g + 1] + 1] for g in range(3)]
        views, counts = stream_views(groups, samples, epochs, [o - o[0] for o in sizes],
                                           [table.view_tokens[o[0]:o[-1]] for o in sizes])
        pack_samples(counts, groups, mandatory=[False] * 3)
        return {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu, "rss": _peak_rss(),
                "before": before}
    arrays, stats, path, _ = cached_build(folder, {"bench": num_samples, "schedule": schedule, "mandatory": mandatory},
                                          lambda sink: write_pack_index(sink, table, config, num_samples))
    # Before items() maps pages of the cache in (file-backed pages of the page cache, which count as RSS).
    seconds, cpu, peak = time.perf_counter() - start, time.process_time() - cpu, _peak_rss()
    packs = PackIndex(config, arrays, stats, table.group_base, path)
    chosen = np.random.default_rng(1).integers(0, len(packs), 20_000)
    timings = []
    for k in chosen.tolist():
        tick = time.perf_counter()
        packs.items(k)
        timings.append(time.perf_counter() - tick)
    sizes = np.diff(np.asarray(arrays["pack_offsets"], dtype=np.int64))[chosen]
    cache_bytes = sum(p.stat().st_size for p in path.glob("*.bin"))
    return {"seconds": seconds, "cpu": cpu, "rss": peak, "before": before, "bytes": cache_bytes,
            "packs": len(packs), "items_us": float(np.median(timings)) * 1e6, "items_pack": float(sizes.mean())}


def _status(field: str) -> float:
    """A memory figure of this process from /proc/self/status, bytes."""
    with open("/proc/self/status") as status:
        return next(float(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:"))


def _rss_now() -> float:
    """Resident memory now; also restarts the peak (VmHWM), so the next _peak_rss is the build's."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return _status("VmRSS")


def _peak_rss() -> float:
    """Peak resident memory of this process since _rss_now."""
    return _status("VmHWM")


def scale_table(sizes: list[int], schedule: bool = False, mandatory: bool = False) -> None:
    """Each build in a fresh process pinned to one core, so peak RSS and time are its own. ``schedule``:
    the plain streamed build against the 3-phase schedule instead (no whole-array row), their ratios under
    the table; ``mandatory``: and the schedule with a mandatory group."""
    print("| samples | build | wall (s) | CPU (s) | peak RSS (GB) (before the build) | cache (B/sample) | packs "
          "| items(k), median (µs) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for num_samples in sizes:
        runs = [("plain", False), ("schedule", False)] + [("mandatory", False)] * mandatory if schedule else \
            [("plain", False)] + [("plain", True)] * (num_samples <= 10**7)
        results = {}
        for kind, whole in runs:
            with tempfile.TemporaryDirectory() as folder:
                child = [sys.executable, __file__, "--scale-run", str(num_samples), folder] + ["--whole"] * whole
                child += ["--schedule"] * (kind in ("schedule", "mandatory")) + ["--mandatory"] * (kind == "mandatory")
                result = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
            results[kind] = result
            name = ("whole-array, in memory (reference)" if whole else
                    "streamed, cached, 3-phase schedule" if kind == "schedule" else
                    "streamed, cached, 3-phase schedule, edit mandatory" if kind == "mandatory" else "streamed, cached")
            cache = f"{result['bytes'] / num_samples:.2f}" if not whole else "–"
            packs = f"{result['packs']:,}" if not whole else "–"
            items = f"{result['items_us']:.1f} ({result['items_pack']:.1f} a pack)" if not whole else "–"
            memory = f"{result['rss'] / 1e9:.2f} ({result['before'] / 1e9:.2f})"
            times = f"{result['seconds']:.1f} | {result['cpu']:.1f}"
            print(f"| {num_samples:.0e} | {name} | {times} | {memory} | {cache} | {packs} | {items} |", flush=True)
        for kind in ("schedule", "mandatory"):
            if kind in results:
                plain, phased = results["plain"], results[kind]
                ratios.append(f"{num_samples:.0e}: {kind} / plain = {phased['seconds'] / plain['seconds']:.2f}× wall, "
                              f"{phased['cpu'] / plain['cpu']:.2f}× CPU, {phased['rss'] / plain['rss']:.2f}× peak RSS")
    for line in ratios:
        print(f"\n{line}")


def write_megatron_pair(prefix: str, sizes: np.ndarray) -> None:
    """A Megatron ``.idx`` of one-sequence documents of ``sizes`` tokens and a sparse ``.bin`` of its size."""
    if not os.path.exists(f"{prefix}.bin"):
        fmt.write_token_index(f"{prefix}.idx", np.dtype(np.uint16), sizes, np.arange(len(sizes) + 1))
        with open(f"{prefix}.bin", "wb") as stream:
            stream.truncate(2 * int(sizes.sum()))


def megatron_gpt_dataset(prefix: str, cache: str, num_samples: int | None) -> tuple[np.ndarray, ...]:
    """Megatron's GPTDataset over the pair at ``prefix``, its indices built into the empty ``cache``."""
    dataset = IndexedDataset(prefix)
    tokenizer = types.SimpleNamespace(vocab_size=32000, eod=0, pad=1, unique_identifiers={"class": "bench"})
    config = gpt_dataset.GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ_LENGTH, blend=([prefix], None), split="1,0,0", tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, path_to_cache=cache)
    documents = np.arange(len(dataset.sequence_lengths), dtype=np.int32)
    built = gpt_dataset.GPTDataset(dataset, prefix, documents, num_samples, Split.train, config)
    return built.document_index, built.sample_index, built.shuffle_index


def mmidx_gpt_dataset(prefix: str, cache: str, num_samples: int | None) -> tuple[np.ndarray, ...]:
    """mmidx's GPTTextDataset over the same pair, its indices built into the empty ``cache``."""
    built = GPTTextDataset(prefix, seq_length=SEQ_LENGTH, num_samples=num_samples, seed=SEED, cache_dir=cache)
    return built.document_index, built.sample_index, built.shuffle_index


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=10_000_000, help="documents, ~1000 tokens on average")
    parser.add_argument("--samples", type=int, default=10_000_000, help="blended and packed samples")
    parser.add_argument("--quick", action="store_true", help="200K documents and 1M samples: a smoke run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs both sides of every row")
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-index", help="the Megatron pair and the caches")
    parser.add_argument("--scale", action="store_true", help="only the pack-index scale table: 10^7, 10^8 samples")
    parser.add_argument("--billion", action="store_true", help="with --scale: 10^9 samples too (minutes)")
    parser.add_argument("--scale-run", nargs=2, metavar=("SAMPLES", "FOLDER"), help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", action="store_true",
                        help="with --scale: the plain streamed build against a 3-phase schedule")
    parser.add_argument("--mandatory", action="store_true",
                        help="with --scale --schedule: also the schedule with the edit group is_mandatory")
    parser.add_argument("--sizes", type=int, nargs="+", help="with --scale: these sample counts instead")
    args = parser.parse_args()
    if args.scale_run:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(json.dumps(scale_run(int(args.scale_run[0]), args.scale_run[1], args.whole, args.schedule,
                                   args.mandatory)))
        return
    if args.scale:
        print(f"Machine: {machine('numpy', 'Cython')}; each build in its own process on one core\n")
        with Watch() as watch:
            scale_table(args.sizes or [10**7, 10**8] + [10**9] * args.billion, args.schedule, args.mandatory)
        print(f"\n{watch.describe()}")
        return
    if args.quick:
        args.docs, args.samples = 200_000, 1_000_000

    rng = np.random.default_rng(0)
    # lognormal with sigma 1 has mean exp(mu + 1/2): mu = ln(1000) - 1/2 gives ~1000 tokens.
    sizes = np.maximum(rng.lognormal(np.log(1000) - 0.5, 1.0, args.docs), 1).astype(np.int32)
    tokens_per_epoch = int(sizes.sum())
    samples_per_epoch = (tokens_per_epoch - 1) // SEQ_LENGTH
    os.makedirs(args.workdir, exist_ok=True)
    prefix = os.path.join(args.workdir, f"documents-{args.docs}")
    write_megatron_pair(prefix, sizes)
    rows: list[tuple[str, list[float] | None, list[float]]] = []
    with Watch() as watch:

        def compare(name: str, ours: Callable[[], object], theirs: Callable[[], object]) -> None:
            turns = interleave({"Megatron": lambda _: theirs(), "mmidx": lambda _: ours()}, [None], args.rounds)
            assert_same(turns.results["mmidx"][0], turns.results["Megatron"][0])
            rows.append((name, turns.per_round("Megatron"), turns.per_round("mmidx")))
            theirs_median, ours_median = np.median(rows[-1][1]), np.median(rows[-1][2])
            print(f"  {name}: Megatron {theirs_median:.3f} s, mmidx {ours_median:.3f} s", flush=True)

        docs = f"{args.docs / 1e6:g}M docs"
        for epochs in (1, 3):
            document_index = build_document_index(
                np.arange(args.docs, dtype=np.int32), epochs, np.random.RandomState(SEED), False
            )
            arguments = (sizes, document_index, SEQ_LENGTH, epochs, tokens_per_epoch)
            compare(
                f"sample_idx kernel, {docs}, {epochs} epoch(s)",
                lambda a=arguments: build_sample_index(*a),
                lambda a=arguments: helpers.build_sample_idx(*a),
            )
        for epochs, num_samples in ((1, None), (3, int(2.9 * samples_per_epoch))):
            compare(
                f"document+sample+shuffle index, {docs}, {epochs} epoch(s)",
                lambda n=num_samples: gpt_indices(sizes, seq_length=SEQ_LENGTH, num_samples=n, seed=SEED),
                lambda n=num_samples: megatron_gpt_indices(sizes, n),
            )
        caches = os.path.join(args.workdir, "caches")  # a new empty cache folder for every build
        for epochs, num_samples in ((1, None), (3, int(2.9 * samples_per_epoch))):
            shutil.rmtree(caches, ignore_errors=True)
            os.makedirs(caches)
            compare(
                f"GPT indices from the files (GPTDataset / GPTTextDataset, cached), {docs}, {epochs} epoch(s)",
                lambda n=num_samples: mmidx_gpt_dataset(prefix, tempfile.mkdtemp(dir=caches), n),
                lambda n=num_samples: megatron_gpt_dataset(prefix, tempfile.mkdtemp(dir=caches), n),
            )
        shutil.rmtree(caches, ignore_errors=True)
        opened = MMIDXDataset(prefix)  # the O(n) structure check inside the row above, and its reference
        check = interleave({"one pass": lambda _: structure_problems(opened),
                            "vectorised": lambda _: vectorised_problems(opened)}, [None], args.rounds)
        assert check.results["one pass"] == check.results["vectorised"] == [[]]

        def shuffled(shuffle: Callable[[np.random.RandomState, np.ndarray], None]) -> np.ndarray:
            array = np.arange(args.docs, dtype=np.int32)
            shuffle(np.random.RandomState(SEED), array)
            return array

        compare(
            f"RandomState.shuffle, {docs} int32",
            lambda: shuffled(legacy_shuffle),
            lambda: shuffled(lambda state, array: state.shuffle(array)),
        )

        samples = f"{args.samples / 1e6:g}M samples"
        for num_datasets in (2, 10, 100):
            weights = np.random.default_rng(num_datasets).random(num_datasets) + 0.01
            compare(
                f"blending, {samples}, {num_datasets} datasets",
                lambda w=weights: blending_indices(w, args.samples),
                lambda w=weights: megatron_blend(w, args.samples),
            )

        # A t2i / edit / vlm mix, ~1100 / ~5000 / ~1500 tokens a sample, with BAGEL's budgets.
        group_sizes, weights = [4_000_000, 1_000_000, 2_000_000], [0.5, 0.2, 0.3]
        stream_time, (groups, _, _) = best_of(
            lambda: multimodal_stream(group_sizes, weights, args.samples, SEED), args.rounds
        )
        rows.append((f"multimodal_stream, {samples}, 3 groups", None, [stream_time]))
        means = np.array([1100, 5000, 1500])
        counts = np.maximum(rng.normal(means[groups], 0.3 * means[groups]), 1).astype(np.int64)
        pack_time, packed = best_of(
            lambda: pack_samples(counts, groups, mandatory=[False] * 3), args.rounds
        )
        rows.append((f"pack_samples, {samples}, BAGEL budgets", None, [pack_time]))

    print(f"\nMachine: {machine('numpy', 'megatron-core', 'Cython')}; {args.rounds} rounds, the sides in turn\n")
    print("| operation | Megatron CPU (s), median | mmidx CPU (s), median "
          "| mmidx / Megatron per round: median (spread) |")
    print("|---|---:|---:|---:|")
    for name, theirs, ours in rows:
        if theirs is None:
            print(f"| {name} | – | {min(ours):.3f} (wall, best) | – |")
        else:
            print(f"| {name} | {np.median(theirs):.3f} | {np.median(ours):.3f} | {ratio(ours, theirs)} |")
    print(f"\nThe O(n) structure check of the {docs} inside GPTTextDataset: one pass of C "
          f"{np.median(check.per_round('one pass')) * 1e3:.1f} ms CPU, the vectorised reference (numpy) "
          f"{np.median(check.per_round('vectorised')) * 1e3:.1f} ms (medians over {args.rounds} rounds, in turn)")
    print(f"\n{watch.describe()}")
    for name, theirs, ours in rows:
        if name.startswith("GPT indices from the files"):
            print(f"Headline, {name}: " + watch.headline(f"{ratio(ours, theirs)} Megatron's CPU time"))
    stats = packed.stats
    print(
        f"\npacking: {stats['num_packs']} packs, fill {stats['fill_vs_max']:.3f} of max, "
        f"{stats['fill_vs_expected']:.3f} of expected, {stats['deferred']} deferred, "
        f"max deferral {stats['max_deferral']} packs, {stats['solo_packs']} solo packs, "
        f"{args.samples / pack_time / 1e6:.0f}M samples/s"
    )


if __name__ == "__main__":
    main()
