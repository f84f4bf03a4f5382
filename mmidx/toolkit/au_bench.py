"""``mmidx bench CONFIG --au`` (and ``--dry``): accelerator utilisation of a data config's loader, with emulated
accelerators in step (:mod:`mmidx.toolkit.au`), and the report.

The pack index is built once, long enough for every rank's runs; each pack's compute comes from the one cost
model (:func:`~mmidx.index.cost.pack_costs` at the model's geometry, of its samples after CFG dropout:
:class:`~mmidx.index.pack_costs.PackCosts`, by which balanced steps deal too) and the stated throughput
(:func:`mmidx.index.accelerator.demand`). A real run starts the ranks (:mod:`mmidx.toolkit.au_ranks`); a dry run
(``dry=True``) does the same accounting from the pack index alone, at any world size. Every real run is reported
beside the dry run of the same micro-steps, so the two can be compared run by run.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from mmidx.config import DataConfig
from mmidx.errors import option
from mmidx.index.accelerator import MODELS, demand
from mmidx.index.cost import LLMGeometry, pack_costs
from mmidx.index.pack_costs import PackCosts
from mmidx.index.pack_index import PackIndex
from mmidx.toolkit.au import PASS_BAR, combine, dry_run, rank_packs, summarize
from mmidx.toolkit.bench import machine, pack_index_holding

MICRO_STEPS = 8  # default global batch: this many micro-steps per rank (the packing guide's W 8, G 64 and W 64, G 512)


def pack_sizes(index: PackIndex, geometry: LLMGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Each pack's forward FLOPs at ``geometry`` and its tokens, as its batch will be built (CFG dropout applied:
    what a rank receives and the balanced deal prices)."""
    offsets, segments = PackCosts(index, geometry).sample_tokens(0, len(index))
    sums = np.concatenate(([0], np.cumsum(segments)))
    return pack_costs(offsets, segments, geometry), sums[offsets[1:]] - sums[offsets[:-1]]


def bench_au(config: DataConfig, *, world_size: int = 2, workers: int = 1, model: str = "qwen2-7b",
             tokens_per_s: float | None = None, calibration: str | os.PathLike | None = None, runs: int = 5,
             steps: int = 10, warmup: int = 2, global_batch_size: int | None = None, balanced: bool = True,
             masks: str = "flex", device: str = "cpu", cache_dir: str | os.PathLike | None = None,
             time_limit: float = 600.0, prefetch_factor: int | None = None, dry: bool = False,
             decode: str = "loader", encodings: str | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """AU of ``world_size`` emulated accelerators training ``model`` on ``config``'s packs, ``runs`` runs of
    ``warmup`` + ``steps`` micro-steps (see :mod:`mmidx.toolkit.au`), each rank with a loader of ``workers``
    workers; ``dry``: the pack index alone. ``global_batch_size``: packs per optimizer step (default
    ``MICRO_STEPS`` per rank), dealt by cost (``balanced``) or in contiguous shares; ``masks``: "flex" (split
    metadata; the model's default throughput with FlexAttention) or "dense" (masks built on ``device``; SDPA's);
    ``time_limit``: seconds a run may take before the ranks stop in step; ``decode`` and ``encodings`` (a precached
    VAE encoding's name) as for :func:`mmidx.toolkit.bench.bench_packs`; ``progress``: told a line as each stage of
    a dry run ends (the pack index, each run), so a large world size is seen to advance."""
    global_batch_size = global_batch_size or MICRO_STEPS * world_size
    if world_size < 1 or global_batch_size % world_size:
        raise ValueError(f"{option('global_batch_size')} ({global_batch_size}) must be a multiple of "
                         f"{option('world_size')} ({world_size})")
    if min(runs, steps) < 1 or warmup < 0:
        raise ValueError(f"need at least one run of at least one measured step, got {option('runs')} {runs} and "
                         f"{option('steps')} {steps}")
    if masks not in ("flex", "dense"):
        raise ValueError(f"{option('masks')} is 'flex' or 'dense' here, not {masks!r}")
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}: one of {', '.join(MODELS)}")
    with tempfile.TemporaryDirectory(prefix="mmidx-au-") as scratch:  # the ranks load the index the parent built
        folder = str(scratch if cache_dir is None else cache_dir)
        per_rank = global_batch_size // world_size
        index = pack_index_holding(config, math.ceil(runs * (warmup + steps) / per_rank) * global_batch_size, folder)
        flops, tokens = pack_sizes(index, MODELS[model].geometry)
        accelerator = demand(model, float(flops.sum() / tokens.sum()), tokens_per_s=tokens_per_s,
                             attention="sdpa" if masks == "dense" else "flex", calibration=calibration)
        costs = flops if balanced else None
        limit = config.packing.max_num_tokens

        def dry_of(first: int, count: int) -> dict[str, Any]:
            packs = rank_packs(len(index), global_batch_size, world_size, first, count, costs)
            return dry_run(accelerator.seconds(flops[packs]), tokens[packs], flops[packs], limit)

        about = {"kind": "au", "dry": dry, "world_size": world_size, "workers": None if dry else workers,
                 "global_batch_size": global_batch_size, "balanced": balanced, "masks": masks, "device": device,
                 "decode": decode, "encodings": encodings,
                 "runs_asked": runs, "warmup": warmup, "steps_asked": steps, "demand": accelerator.describe(),
                 "packing_policy": config.packing.policy, "max_num_tokens": limit, "pass_bar": PASS_BAR,
                 "machine": machine("torch"), "load_average": os.getloadavg()[0]}
        if dry:
            if progress:
                progress(f"pack index: {len(index):,} packs, {world_size:,} ranks of {per_rank} micro-steps per "
                         "global batch")
            dries = []
            for run in range(runs):
                dries.append(dry_of(run * (warmup + steps) + warmup, steps))
                if progress:
                    progress(f"dry run {run + 1}/{runs}: au {dries[-1]['au']:.3f}")
            return {**about, **combine(dries), "runs": dries}
        from mmidx.toolkit.au_ranks import PackFeed, run_ranks

        feed = PackFeed(config, num_samples=int(index.stats["samples"]), cache_dir=folder,
                        global_batch_size=global_batch_size, workers=workers, masks=masks, device=device,
                        geometry=accelerator.geometry, balanced=balanced, prefetch_factor=prefetch_factor,
                        decode=decode, encodings={"vae": encodings} if encodings else None)
        measured = run_ranks(feed, world_size=world_size, runs=runs, warmup=warmup, steps=steps,
                             time_limit=time_limit, seconds_per_flop=accelerator.seconds_per_flop)
        reports = []
        for run, (first, ranks) in enumerate(measured):
            if not all(ranks):
                raise ValueError(f"run {run + 1}: the time limit of {time_limit:g} s passed before a step was "
                                 f"measured (the loader is far slower than the demand): raise {option('time_limit')} "
                                 f"or lower {option('warmup')}")
            report = summarize(ranks, limit)
            report["dry_au"] = dry_of(first, report["steps"])["au"]
            # what this run's own batches allow: its compute, no stall, each rank waiting for the dearest batch
            received = [[[step.compute_s, step.batch.tokens, step.batch.flops] for step in rank] for rank in ranks]
            compute, batch_tokens, batch_flops = np.array(received).transpose(2, 1, 0)
            report["balance_au"] = dry_run(compute, batch_tokens, batch_flops, limit)["au"]
            reports.append(report)
    return {**about, **combine(reports), "dry_au": statistics.median(r["dry_au"] for r in reports),
            "balance_au": statistics.median(r["balance_au"] for r in reports), "runs": reports}


def _seconds(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_au(result: dict[str, Any]) -> str:
    """The report a person reads: what ran, each run's AU and where the rest of its time went, the verdict, and
    the CPU a pack costs and the cores one accelerator needs."""
    d, dry = result["demand"], result["dry"]
    world, batch = result["world_size"], result["global_batch_size"]
    workers = result["workers"]
    what = ("a dry run (the pack index alone: no loader, no stall)" if dry else
            f"{workers} loader worker{'s' if workers != 1 else ''} per rank, batches finished on {result['device']}")
    deal = "dealt by cost (balanced steps)" if result["balanced"] else "in contiguous shares"
    lines = [f"# mmidx bench --au: {world} emulated accelerators in step (an all-reduce ends each micro-step), {what}",
             f"# global batch {batch} packs ({batch // world} micro-steps per rank) {deal}; {result['packing_policy']} "
             f"packs of at most {result['max_num_tokens']:,} tokens; {result['masks']} masks",
             f"# demand: {d['model']} at {d['tokens_per_s']:,.0f} tokens/s per accelerator on packs of this config's "
             f"average cost ({d['seconds_per_flop']:.3g} s per FLOP): {d['source']}",
             f"# {result['runs_asked']} run{'s' if result['runs_asked'] != 1 else ''} of {result['warmup']} warm-up + "
             f"{result['steps_asked']} measured micro-steps; seconds per rank, mean over ranks",
             f"{'run':>3} {'au':>6} {'steps':>5} {'wall s':>8} {'compute s':>9} {'stall s':>8} {'balance s':>9} "
             f"{'other s':>7} {'fill':>6}" + ("" if dry else f" {'dry au':>6} {'allowed':>7}")]
    for number, run in enumerate(result["runs"], 1):
        lines.append(f"{number:>3} {run['au']:>6.3f} {run['steps']:>5} {run['wall_s']:>8.2f} {run['compute_s']:>9.2f} "
                     f"{run['data_stall_s']:>8.2f} {run['balance_wait_s']:>9.2f} {run['other_s']:>7.3f} "
                     f"{run['fill']:>6.3f}" + ("" if dry else f" {run['dry_au']:>6.3f} {run['balance_au']:>7.3f}"))
    verdict = "passes" if result["passes"] else "does not pass"
    lines.append(f"au {result['au']:.3f} (median), {result['au_min']:.3f} (minimum), {result['au_mean']:.3f} (mean): "
                 f"{verdict} MLPerf Storage's bar of {result['pass_bar']:.0%} in every run")
    if not dry:
        lines.append(f"dry run of the same micro-steps (the pack index's sizes): au {result['dry_au']:.3f}; the "
                     f"batches received (CFG dropout applied) allow {result['balance_au']:.3f}: the loader and the "
                     f"harness cost {100 * (result['balance_au'] - result['au']):.1f} points")
        cpu = result["cpu_s_per_pack"]
        lines.append(f"cpu s per pack: loader worker {_seconds(cpu['workers'], 3)} (building it "
                     f"{_seconds(cpu['build'], 3)}, the rest handing it over), trainer process "
                     f"{_seconds(cpu['trainer'], 3)}, total {_seconds(cpu['total'], 3)}; an accelerator consumes "
                     f"{result['packs_per_s_per_accelerator']:.3f} packs/s: "
                     f"{_seconds(result['cores_per_accelerator'])} cores per accelerator")
    lines.append(f"# {result['machine']}; load average {result['load_average']:.2f} at the start")
    return "\n".join(lines)
