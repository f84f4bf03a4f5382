"""Accelerator utilisation (``mmidx bench --au``'s harness) of mmidx's loader and BAGEL's, side by side.

Every figure comes from the same harness (:mod:`mmidx.toolkit.au`): emulated accelerators in a gloo group, each
sleeping its micro-batch's modelled compute (the cost model at the model's geometry, at the model's default
tokens/s for the attention used), an all-reduce ending each micro-step, warm-up excluded. The corpus is
bagel_peer's (t2i parquet, edit parquet, vlm JSONL + images, 512² JPEGs), read by mmidx from its datasets and by
BAGEL's own ``PackedDataset`` (``--bagel-src``, imported unmodified; ``--bagel-site`` for torchvision and decord
beside a CPU torch) from the raw files, with the same budgets, dropout and tokenizer. Both sides run at the same
demand: the seconds per FLOP of the kind's mmidx packs at the model's default tokens/s.

Tables (each a subcommand; ``all`` runs them in turn):

* ``cores``: per kind (t2i, edit, vlm, mix) and masks (flex, dense), each side's CPU seconds per pack (its loader
  workers', and its trainer process's: receiving the batch and ``to_dict()``, where mmidx builds dense masks) and
  the cores one accelerator needs (CPU seconds per pack × the packs per second it consumes), and BAGEL's ÷ mmidx's;
* ``chart``: AU against loader workers per accelerator, both sides, one kind, a PNG (``--png``; needs matplotlib);
* ``remote``: mmidx's AU with the datasets in S3 (moto's server behind bench_remote.py's latency proxy) against
  the same run on local files, per added latency, at the 7B demand with the default prefetch and at the 1.5B
  demand per worker count and DataLoader prefetch factor;
* ``policies``: the ``bagel`` and ``tight`` packing policies at the same demand: worlds 2 and 4 measured, 8, 64
  and 512 dry (the pack index alone).

    python benchmarks/bench_au.py cores --bagel-src /work/bagel-src --bagel-site /work/bagel-site

On a loaded machine the figures are indicative: the load and other processes' cores are printed under each table
(benchmarks/common.py's Watch), and the lead reruns them quietly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from bagel_peer import BUDGETS, DROPOUT, MODES, import_bagel, packed_dataset, prepare
from common import Watch, machine

from mmidx.config import DataConfig
from mmidx.index.accelerator import MODELS
from mmidx.index.cost import LLMGeometry
from mmidx.toolkit.au import Received, WorkerClocks, combine, receive, summarize
from mmidx.toolkit.au_bench import bench_au
from mmidx.toolkit.au_ranks import run_ranks


def kind_config(datasets: Path, groups: list[str], policy: str = "bagel") -> DataConfig:
    """The mmidx data config of a kind's groups, with bench_pack's budgets and dropout."""
    spec = yaml.safe_load((datasets / "data.yaml").read_text())
    return DataConfig.from_dict({"groups": {g: spec["groups"][g] for g in groups},
                                 "packing": {**BUDGETS, "policy": policy}, "dropout": DROPOUT}, base_dir=datasets)


class _StampedCollate:
    """BAGEL's collate (``collate_wrapper()``: a ``SimpleCustomBatch``), with the loader worker's stamp
    (:meth:`mmidx.toolkit.au.WorkerClocks.stamp`)."""

    def __call__(self, batch: list[Any]) -> tuple[Any, tuple[int, float, float] | None]:
        from data.dataset_base import collate_wrapper

        worker = torch.utils.data.get_worker_info()
        return collate_wrapper()(batch), None if worker is None else WorkerClocks.stamp(worker.id)


class BagelFeed:
    """BAGEL's loader for one rank, as its trainer builds it: ``PackedDataset`` for (rank, world size, workers) in
    ``DataLoader(batch_size=1, collate_fn=collate_wrapper())``, each batch's ``to_dict()`` taken (``.cuda()``
    first on a GPU); its FLOPs from its samples (less flex's padding pseudo-sample) at ``geometry``."""

    def __init__(self, raw: Path, groups: list[str], use_flex: bool, bagel_src: str, bagel_site: str | None,
                 workers: int, geometry: LLMGeometry, prefetch_factor: int | None = None):
        self.raw, self.groups, self.use_flex = raw, groups, use_flex
        self.bagel_src, self.bagel_site, self.workers = bagel_src, bagel_site, workers
        self.geometry, self.prefetch_factor = geometry, prefetch_factor
        self.position, self.dataset = 0, None

    def open(self, rank: int, world_size: int) -> None:
        import_bagel(self.bagel_src, self.bagel_site)
        self.dataset = packed_dataset(self.raw, self.groups, self.use_flex, rank=rank, world_size=world_size,
                                      num_workers=max(1, self.workers))

    def batches(self) -> Iterator[Received]:
        extra = {"prefetch_factor": self.prefetch_factor} if self.workers and self.prefetch_factor else {}
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=1, num_workers=self.workers,
                                             collate_fn=_StampedCollate(), **extra)
        packs = iter(loader)
        try:
            yield from receive(packs, self._finish, self.geometry)
        finally:
            del packs  # its workers stop with it

    def _finish(self, batch: Any) -> tuple[int, list[int]]:
        data = batch.to_dict()  # its trainer's data.cuda(device).to_dict(), on this CPU
        lengths = data["sample_lens"][:-1] if self.use_flex else data["sample_lens"]  # less flex's padding
        if sum(lengths) != data["sequence_length"]:
            raise AssertionError(f"BAGEL's sample_lens sum to {sum(lengths)}, not {data['sequence_length']}")
        self.position += 1
        return data["sequence_length"], lengths


def bagel_au(feed: BagelFeed, *, world_size: int, runs: int, warmup: int, steps: int, spf: float,
             max_num_tokens: int) -> dict[str, Any]:
    """The harness's report for BAGEL's loader (no pack index: no dry run to compare with)."""
    measured = run_ranks(feed, world_size=world_size, runs=runs, warmup=warmup, steps=steps, time_limit=1800,
                         seconds_per_flop=spf)
    reports = [summarize(ranks, max_num_tokens) for _, ranks in measured]
    return {**combine(reports), "runs": reports}


def mmidx_au(config: DataConfig, args: argparse.Namespace, **options: Any) -> dict[str, Any]:
    settings = {"world_size": args.world_size, "workers": args.workers[0], "model": args.model, "runs": args.runs,
                "steps": args.steps, "warmup": args.warmup, "cache_dir": args.cache_dir, "time_limit": 1800, **options}
    return bench_au(config, **settings)


def table_cores(args: argparse.Namespace, raw: Path, datasets: Path) -> dict[str, Any]:
    rows = {}
    rates = MODELS[args.model].tokens_per_s
    print(f"# cores: {args.world_size} accelerator(s), {args.workers[0]} worker(s) each, {args.model} at its default "
          f"tokens/s ({rates['flex']:,.0f} flex, {rates['sdpa']:,.0f} dense); CPU s per pack = loader worker (build: "
          "its main thread; the rest: handing the pack over) + trainer process")
    print(f"{'kind':<5} {'masks':<5} {'side':<6} {'au':>6} {'worker s':>8} {'build s':>7} {'trainer s':>9} "
          f"{'total s':>7} {'packs/s':>7} {'cores/acc':>9} {'BAGEL ÷ mmidx':>13}")
    with Watch() as watch:
        for kind in args.kinds:
            config = kind_config(datasets, MODES[kind])
            for masks in ("flex", "dense"):
                sides = {"mmidx": mmidx_au(config, args, masks=masks)}
                if args.bagel_src:  # at mmidx's demand: its seconds per FLOP
                    spf = sides["mmidx"]["demand"]["seconds_per_flop"]
                    feed = BagelFeed(raw, MODES[kind], masks == "flex", args.bagel_src, args.bagel_site,
                                     args.workers[0], MODELS[args.model].geometry)
                    sides["BAGEL"] = bagel_au(feed, world_size=args.world_size, runs=args.runs, warmup=args.warmup,
                                              steps=args.steps, spf=spf, max_num_tokens=BUDGETS["max_num_tokens"])
                for side, r in sides.items():
                    cpu = r["cpu_s_per_pack"]
                    times = (r["cores_per_accelerator"] / sides["mmidx"]["cores_per_accelerator"]
                             if side == "BAGEL" else None)
                    print(f"{kind:<5} {masks:<5} {side:<6} {r['au']:>6.3f} {cpu['workers']:>8.3f} {cpu['build']:>7.3f} "
                          f"{cpu['trainer']:>9.3f} {cpu['total']:>7.3f} {r['packs_per_s_per_accelerator']:>7.3f} "
                          f"{r['cores_per_accelerator']:>9.3f} {'' if times is None else f'{times:.2f}×':>13}",
                          flush=True)
                rows[f"{kind} {masks}"] = sides
    print(f"# {watch.describe()}")
    return rows


def table_chart(args: argparse.Namespace, raw: Path, datasets: Path) -> dict[str, Any]:
    config = kind_config(datasets, MODES[args.chart_kind])
    points: dict[str, list[tuple[int, float]]] = {"mmidx": [], "BAGEL": []}
    with Watch() as watch:
        for workers in args.workers:
            result = mmidx_au(config, args, workers=workers, model=args.chart_model, masks="flex")
            points["mmidx"].append((workers, result["au"]))
            spf = result["demand"]["seconds_per_flop"]
            if args.bagel_src:
                feed = BagelFeed(raw, MODES[args.chart_kind], True, args.bagel_src, args.bagel_site, workers,
                                 MODELS[args.chart_model].geometry)
                result = bagel_au(feed, world_size=args.world_size, runs=args.runs, warmup=args.warmup,
                                  steps=args.steps, spf=spf, max_num_tokens=BUDGETS["max_num_tokens"])
                points["BAGEL"].append((workers, result["au"]))
            print(f"workers {workers}: " + ", ".join(f"{side} au {dict(p)[workers]:.3f}" for side, p in points.items()
                                                    if p), flush=True)
    print(f"# {watch.describe()}")
    if args.png:
        plot(points, args, watch.describe())
    return points


def plot(points: dict[str, list[tuple[int, float]]], args: argparse.Namespace, load: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for side, marker in (("mmidx", "o"), ("BAGEL", "s")):
        if points[side]:
            workers, au = zip(*points[side], strict=True)
            axes.plot(workers, au, marker=marker, label=f"{side}'s loader")
    axes.axhline(0.9, color="grey", linestyle="--", linewidth=1, label="MLPerf Storage's pass bar (90%)")
    axes.set_xlabel("loader workers per accelerator")
    axes.set_ylabel("accelerator utilisation (AU)")
    axes.set_xticks(args.workers)
    axes.set_ylim(0, 1.05)
    accelerators = f"{args.world_size} accelerator{'s' if args.world_size != 1 else ''}"
    axes.set_title(f"{args.chart_kind} packs, {args.chart_model} at its FlexAttention tokens/s, {accelerators}",
                   fontsize=9)
    axes.legend(loc="lower right", fontsize=8)
    figure.text(0.01, 0.01, textwrap.fill(load, 150), fontsize=5, color="grey")
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(args.png)
    print(f"# chart: {args.png}")


def table_policies(args: argparse.Namespace, datasets: Path) -> dict[str, Any]:
    rows = {}
    print(f"# policies: {args.model} at its default tokens/s (flex), mix kind, balanced steps, global batch 8 per rank")
    print(f"{'world':>5} {'run':<5} {'bagel au':>8} {'tight au':>8} {'bagel fill':>10} {'tight fill':>10}")
    with Watch() as watch:
        for world in (2, 4, 8, 64, 512):
            dry = world > 4
            results = {policy: mmidx_au(kind_config(datasets, MODES["mix"], policy), args, world_size=world, dry=dry,
                                        masks="flex") for policy in ("bagel", "tight")}
            rows[world] = results
            bagel, tight = results["bagel"], results["tight"]
            print(f"{world:>5} {'dry' if dry else 'real':<5} {bagel['au']:>8.3f} {tight['au']:>8.3f} "
                  f"{bagel['fill']:>10.3f} {tight['fill']:>10.3f}", flush=True)
    print(f"# {watch.describe()}")
    return rows


def table_remote(args: argparse.Namespace, datasets: Path) -> dict[str, Any]:
    import logging

    import boto3
    from bench_remote import DelayProxy, upload
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    results: dict[str, Any] = {}
    try:
        for delay_ms in args.delays:
            proxy = DelayProxy(server.get_host_and_port(), delay_ms / 1000)
            os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                              AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}",
                              MMIDX_CACHE_DIR=str(Path(args.cache_dir) / f"remote-{delay_ms}"))
            client = boto3.client("s3")
            if delay_ms == args.delays[0]:
                client.create_bucket(Bucket="bench")
                for group in MODES["mix"]:
                    for prefix in kind_config(datasets, [group]).groups[0].datasets:
                        upload(client, Path(prefix), f"data/{group}/{Path(prefix).name}")
            local = kind_config(datasets, MODES["mix"])
            remote = dataclasses.replace(local, groups=[
                dataclasses.replace(g, datasets=[f"s3://bench/data/{g.name}/{Path(p).name}" for p in g.datasets])
                for g in local.groups])
            print(f"# remote: {delay_ms} ms added per request; mix kind, flex; AU local vs s3 (median of runs)")
            print(f"{'model':<11} {'workers':>7} {'prefetch':>8} {'local au':>8} {'s3 au':>6} {'points':>7}")
            with Watch() as watch:
                for model, settings in (("qwen2-7b", [(args.workers[0], None)]),
                                        ("qwen2-1.5b", [(w, f) for w in args.workers for f in args.prefetch])):
                    for workers, factor in settings:
                        pair = {where: mmidx_au(config, args, model=model, workers=workers, masks="flex",
                                                prefetch_factor=factor)["au"]
                                for where, config in (("local", local), ("s3", remote))}
                        results[f"{delay_ms} {model} {workers} {factor}"] = pair
                        print(f"{model:<11} {workers:>7} {factor or 'default':>8} {pair['local']:>8.3f} "
                              f"{pair['s3']:>6.3f} {100 * (pair['s3'] - pair['local']):>+7.1f}", flush=True)
            print(f"# {watch.describe()}")
    finally:
        server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=("cores", "chart", "remote", "policies", "all"))
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-pack", help="bagel_peer's corpus and datasets")
    parser.add_argument("--cache-dir", help="pack indexes (default: a temporary folder)")
    parser.add_argument("--bagel-src", help="a checkout of ByteDance-Seed/Bagel (BAGEL's side; else mmidx's only)")
    parser.add_argument("--bagel-site", help="torchvision and decord for BAGEL beside a CPU torch (bagel_peer.py)")
    parser.add_argument("--kinds", default="t2i,edit,vlm,mix", type=lambda text: text.split(","))
    parser.add_argument("--model", default="qwen2-7b", choices=list(MODELS))
    parser.add_argument("--world-size", type=int, default=1, help="accelerators (cores, chart, remote)")
    parser.add_argument("--workers", default="1", type=lambda text: [int(w) for w in text.split(",")],
                        help="loader workers per accelerator (chart: each a point; remote: each a row at 1.5B)")
    parser.add_argument("--prefetch", default="2,4", type=lambda text: [int(f) for f in text.split(",")],
                        help="DataLoader prefetch factors tried at the 1.5B demand (remote)")
    parser.add_argument("--delays", default="20,50", type=lambda text: [float(d) for d in text.split(",")],
                        help="ms added per S3 request (remote)")
    parser.add_argument("--chart-kind", default="mix", choices=list(MODES))
    parser.add_argument("--chart-model", default="qwen2-1.5b", choices=list(MODELS))
    parser.add_argument("--png", help="where the chart's PNG goes (chart)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json-out", help="also write every result as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    raw, datasets = prepare(Path(args.workdir))
    print(f"# bench_au — {machine('torch')}")
    with tempfile.TemporaryDirectory(prefix="bench-au-") as scratch:
        args.cache_dir = args.cache_dir or scratch
        tables = ("cores", "chart", "policies", "remote") if args.table == "all" else (args.table,)
        out = {}
        for table in tables:
            start = time.perf_counter()
            out[table] = {"cores": lambda: table_cores(args, raw, datasets),
                          "chart": lambda: table_chart(args, raw, datasets),
                          "policies": lambda: table_policies(args, datasets),
                          "remote": lambda: table_remote(args, datasets)}[table]()
            print(f"# {table}: {time.perf_counter() - start:.0f} s", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
