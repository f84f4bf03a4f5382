"""``mmidx bench``, ``sample``, ``export`` and ``demo``: measure, look at one sample, write a dataset back to a
source layout, and the end-to-end demo.
"""

from __future__ import annotations

import argparse
import functools
import json
import warnings

from mmidx.cli.common import (
    PREFIX,
    PREFIX_HELP,
    Commands,
    add_cache_arguments,
    add_command,
    add_pack_arguments,
    at_least,
    default_note,
    named_output,
    one_dataset,
)
from mmidx.cli.index import _data_config


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = [-1]
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of worker counts (e.g. 0,1,2,4)")
    return counts


def cmd_bench(args: argparse.Namespace) -> int:
    from mmidx.toolkit import bench

    # the worker counts are the user's choice and the report names the cores: torch's advice is noise here
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    if args.au or args.dry:
        return _bench_au(args)
    config = _data_config(args)
    workers = args.workers or [0, 1, 2, 4]
    if bench.text_only(config):
        result = bench.bench_gpt([p for group in config.groups for p in group.datasets], seq_length=args.seq_length,
                                 samples=args.gpt_samples, workers=workers)
    else:
        result = bench.bench_packs(config, packs=args.packs, workers=workers, decode=args.decode,
                                   masks=args.masks, target_tokens_per_s=args.target_tokens_per_s,
                                   device=args.device, cache_dir=args.cache_dir, encodings=args.encodings)
    print(json.dumps(result, indent=1) if args.json else bench.format_report(result))
    return 0


def _bench_au(args: argparse.Namespace) -> int:
    from mmidx.toolkit.au_bench import bench_au, format_au

    if args.masks == "none":
        args.usage_error("--au: the trainer receives flex (split metadata) or dense batches: --masks flex or dense")
    if args.workers is not None and len(args.workers) != 1:
        args.usage_error("--au runs one worker count per run: give --workers N")
    if args.tokens_per_s is not None and args.calibration is not None:
        args.usage_error("give --tokens-per-s or --calibration, not both")
    workers = args.workers[0] if args.workers else 1
    result = bench_au(_data_config(args), world_size=args.world_size, workers=workers, model=args.model,
                      tokens_per_s=args.tokens_per_s, calibration=args.calibration, runs=args.runs, steps=args.steps,
                      warmup=args.warmup, global_batch_size=args.global_batch_size, balanced=not args.contiguous,
                      masks=args.masks, device=args.device or "cpu", cache_dir=args.cache_dir,
                      time_limit=args.time_limit, prefetch_factor=args.prefetch_factor, dry=args.dry,
                      decode=args.decode, encodings=args.encodings)
    print(json.dumps(result, indent=1) if args.json else format_au(result))
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from mmidx.toolkit.sample import describe_sample, format_sample

    info = describe_sample(args.prefix, args.index, view=args.view, output_dir=args.output)
    print(json.dumps(info, indent=1) if args.json else format_sample(info))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mmidx.toolkit.export import export
    from mmidx.toolkit.export_hf import export_hf

    output = named_output(args, args.folder, "the folder as a last argument (mmidx export PREFIX --to LAYOUT FOLDER)")
    run = {"workers": args.workers, "engine": args.engine, "ray_address": args.ray_address, "progress": not args.quiet}
    report = export_hf(args.prefix, output, **run) if args.to == "hf" else export(args.prefix, args.to, output, **run)
    print(report.summary())
    return 0


def _register_toolkit(commands: Commands) -> None:
    sub = add_command(commands, "bench", cmd_bench,
                      "Time the torch loader on this machine: packs/s, tokens/s, samples/s and MB/s per worker "
                      "count, a stage breakdown, and the cores a target tokens/s needs (GPT samples/s for text).")
    add_pack_arguments(sub, num_samples=False)
    sub.add_argument("--packs", type=at_least(2), default=20,
                     help="packs per worker count; the first is not timed")
    sub.add_argument("--workers", type=_worker_counts,
                     help=default_note("comma-separated DataLoader worker counts (--au: one count, per rank)",
                                       "0,1,2,4; --au: 1"))
    sub.add_argument("--decode", choices=("loader", "device"), default="loader",
                     help="decode images in the loader workers, or ship encoded bytes and decode on the device")
    sub.add_argument("--masks", choices=("none", "dense", "flex"), default="flex",
                     help="attention masks built in the main process")
    sub.add_argument("--target-tokens-per-s", type=at_least(1, float), default=100_000,
                     help="tokens/s the loader must feed, for the cores-needed line")
    sub.add_argument("--seq-length", type=at_least(1), default=2048,
                     help="GPT sample length, for text datasets")
    sub.add_argument("--gpt-samples", type=at_least(2), default=2000,
                     help="GPT samples per worker count, for text datasets")
    sub.add_argument("--device", help="where batches go and masks are built (default: cuda if available, else cpu)")
    sub.add_argument("--encodings", metavar="NAME",
                     help="a precached VAE encoding (mmidx precache): also time packs with its latents, against pixels")
    sub.add_argument("--json", action="store_true", help="print the results as JSON")
    _add_au_arguments(sub)
    sub = add_command(commands, "sample", cmd_sample,
                      "Show one sample as a person reads it: each element of a view, decoded texts, images, origin.")
    sub.add_argument("prefix", type=one_dataset, metavar=PREFIX, help=PREFIX_HELP)
    sub.add_argument("index", type=at_least(0), metavar="SAMPLE", help="sample number")
    sub.add_argument("--view", type=at_least(0), default=0,
                     help="view number; epoch e reads view e mod views")
    sub.add_argument("-o", "--output", help=default_note("folder to write the sample's images to", "none written"))
    sub.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_cache_arguments(sub)
    sub = add_command(commands, "export", cmd_export,
                      "Write a dataset back to a raw layout BAGEL reads (t2i/edit parquet, LLaVA JSONL + images) "
                      "or to WebDataset tars or a Hugging Face datasets folder (load_from_disk), with the original "
                      "image bytes.")
    sub.add_argument("prefix", type=one_dataset, metavar=PREFIX, help=PREFIX_HELP)
    sub.add_argument("--to", required=True, choices=("parquet", "jsonl", "wds", "hf"), help="layout to write")
    sub.add_argument("-o", "--output", metavar="FOLDER", help="folder to write (created; must not hold files already)")
    sub.add_argument("folder", nargs="?", help=argparse.SUPPRESS)  # deprecated: the folder, named with --output now
    sub.set_defaults(late_positional="folder")  # the old form gave it after --to: mmidx export PREFIX --to X FOLDER
    sub.add_argument("--workers", type=at_least(1), default=1,
                     help="worker processes making the rows (--engine ray: actors); the files are the same at any "
                          "count")
    sub.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="local processes or actors of a Ray cluster (pip install \"mmidx[ray]\"; the dataset must "
                          "be readable there)")
    sub.add_argument("--ray-address", help=default_note("Ray cluster to join", "RAY_ADDRESS, else a new local one"))
    sub.add_argument("--quiet", action="store_true", help="no progress bar")
    add_cache_arguments(sub)


def _add_au_arguments(sub: argparse.ArgumentParser) -> None:
    from mmidx.index.accelerator import MODELS

    au = sub.add_argument_group(
        "accelerator utilisation (--au)", "emulated accelerators in step, as MLPerf Storage measures AU: each rank "
        "a process with its own loader (--workers), sleeping its micro-batch's modelled compute time, every "
        "micro-step ending in an all-reduce; AU = compute ÷ wall, warm-up excluded (the guide's 'Sizing the loader')")
    au.add_argument("--au", action="store_true", help="measure AU instead of the loader's rates")
    au.add_argument("--dry", action="store_true",
                    help="the same accounting from the pack index alone, no loader: any world size")
    au.add_argument("--world-size", type=at_least(1), default=2, help="emulated accelerators (ranks)")
    au.add_argument("--model", choices=list(MODELS), default="qwen2-7b",
                    help="the LLM whose cost model (mmidx.index.cost) gives each micro-batch's FLOPs")
    au.add_argument("--tokens-per-s", type=at_least(1e-9, float),
                    help=default_note("tokens/s of one accelerator on packs of this config's average cost",
                                      "the model's published figure for the --masks attention, printed with its "
                                      "source"))
    au.add_argument("--calibration", metavar="FILE",
                    help="seconds per FLOP measured on a GPU (benchmarks/gpu_suite.py --items cost_model writes it)")
    au.add_argument("--runs", type=at_least(1), default=5, help="measured runs (MLPerf Storage: 5)")
    au.add_argument("--steps", type=at_least(1), default=10, help="measured micro-steps per rank and run")
    au.add_argument("--warmup", type=at_least(0), default=2, help="micro-steps per run before the clock starts")
    au.add_argument("--global-batch-size", type=at_least(1),
                    help=default_note("packs per optimizer step, a multiple of --world-size", "8 per rank"))
    au.add_argument("--contiguous", action="store_true",
                    help="ranks take contiguous shares of each global batch instead of balanced steps (by cost)")
    au.add_argument("--time-limit", type=at_least(1, float), default=600.0,
                    help="seconds a run may take; past it the ranks stop together at the next step")
    au.add_argument("--prefetch-factor", type=at_least(1), help=default_note("batches each worker builds ahead",
                                                                             "torch's, 2"))


def cmd_demo(args: argparse.Namespace) -> int:
    from mmidx.toolkit.demo import format_summary, run

    result = run(args.workdir, quick=args.quick, progress=functools.partial(print, flush=True))
    print(format_summary(result))
    return 0 if not result["problems"] and all(r.ok for r in result["reports"]) else 1


def _register_demo(commands: Commands) -> None:
    sub = add_command(commands, "demo", cmd_demo,
                      "Generate BAGEL-style sample data, build, index and pack it, and print a summary.")
    sub.add_argument("--workdir", default="mmidx-demo",
                     help="folder for the generated data and outputs: a new or empty one, or an earlier demo's (its "
                          "corpus and datasets reused when unchanged); never a folder of other files")
    sub.add_argument("--quick", action="store_true", help="a smaller corpus (for tests)")


def register(commands: Commands) -> None:
    """Add this module's commands to the parser."""
    _register_toolkit(commands)
    _register_demo(commands)
