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
    config = _data_config(args)
    if bench.text_only(config):
        result = bench.bench_gpt([p for group in config.groups for p in group.datasets], seq_length=args.seq_length,
                                 samples=args.gpt_samples, workers=args.workers)
    else:
        result = bench.bench_packs(config, packs=args.packs, workers=args.workers, decode=args.decode,
                                   masks=args.masks, target_tokens_per_s=args.target_tokens_per_s,
                                   device=args.device, cache_dir=args.cache_dir, encodings=args.encodings)
    print(json.dumps(result, indent=1) if args.json else bench.format_report(result))
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
    report = export_hf(args.prefix, output) if args.to == "hf" else export(args.prefix, args.to, output)
    print(report.summary())
    return 0


def _register_toolkit(commands: Commands) -> None:
    sub = add_command(commands, "bench", cmd_bench,
                      "Time the torch loader on this machine: packs/s, tokens/s, samples/s and MB/s per worker "
                      "count, a stage breakdown, and the cores a target tokens/s needs (GPT samples/s for text).")
    add_pack_arguments(sub, num_samples=False)
    sub.add_argument("--packs", type=at_least(2), default=20,
                     help="packs per worker count; the first is not timed")
    sub.add_argument("--workers", type=_worker_counts, default="0,1,2,4",
                     help="comma-separated DataLoader worker counts")
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
    sub = add_command(commands, "sample", cmd_sample,
                      "Show one sample as a person reads it: each element of a view, decoded texts, images, origin.")
    sub.add_argument("prefix", type=one_dataset, metavar=PREFIX, help=PREFIX_HELP)
    sub.add_argument("index", type=at_least(0), metavar="SAMPLE", help="sample number")
    sub.add_argument("--view", type=at_least(0), default=0,
                     help="view number; epoch e reads view e mod views")
    sub.add_argument("-o", "--output", help=default_note("folder to write the sample's images to", "none written"))
    sub.add_argument("--json", action="store_true", help="print machine-readable JSON")
    sub = add_command(commands, "export", cmd_export,
                      "Write a dataset back to a raw layout BAGEL reads (t2i/edit parquet, LLaVA JSONL + images) "
                      "or to WebDataset tars or a Hugging Face datasets folder (load_from_disk), with the original "
                      "image bytes.")
    sub.add_argument("prefix", type=one_dataset, metavar=PREFIX, help=PREFIX_HELP)
    sub.add_argument("--to", required=True, choices=("parquet", "jsonl", "wds", "hf"), help="layout to write")
    sub.add_argument("-o", "--output", metavar="FOLDER", help="folder to write (created; must not hold files already)")
    sub.add_argument("folder", nargs="?", help=argparse.SUPPRESS)  # deprecated: the folder, named with --output now
    sub.set_defaults(late_positional="folder")  # the old form gave it after --to: mmidx export PREFIX --to X FOLDER


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
