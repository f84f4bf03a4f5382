"""The mmidx command line: build, merge, index, inspect, verify, fetch, show, bench, sample, export, demo.

Each subcommand is a small function taking the parsed arguments and returning an exit code;
``main`` wires them to argparse and turns any error that escapes them into one line and exit status 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import mmidx
from mmidx.format import SUFFIXES, FormatError

EXIT_STATUSES = """exit status: 0 success; 1 failure (bad or missing file, bad data, a problem found), reported in
one line naming the path and the cause; 2 usage error (unknown option, bad value)."""


def dataset_prefix(value: str) -> str:
    """A dataset prefix as the user may give it: ``ds/t2i``, or one of its files (``ds/t2i.idx``,
    ``ds/t2i.bin``, ``ds/t2i.meta.json``...). A suffix is kept when it is part of a prefix whose
    files exist (``x.bin`` with ``x.bin.idx`` beside it)."""
    for suffix in SUFFIXES.values():
        if value.endswith(suffix) and not os.path.exists(value + SUFFIXES["idx"]):
            return value.removesuffix(suffix)
    return value


def _human_bytes(size: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def _describe(stats: dict[str, float]) -> str:
    if not stats.get("count"):
        return "none"
    return (f"min {stats['min']:g}  mean {stats['mean']:g}  p50 {stats['p50']:g}  "
            f"p99 {stats['p99']:g}  max {stats['max']:g}")


def format_summary(info: dict[str, Any]) -> str:
    """The human-readable form of :func:`mmidx.checks.summary`."""
    lines = [f"mmidx dataset {info['prefix']}  (format {info['format_version']}, {info['kind']}, "
             f"{info['token_dtype']} tokens, tokenizer {info['tokenizer'] or 'unrecorded'})"]
    counts = f"  samples {info['samples']:,}   sequences {info['sequences']:,}   tokens {info['tokens']:,}"
    if "views" in info:
        counts += f"   views {info['views']:,}   images {info['images']['count']:,}"
    lines += [counts,
              f"  tokens/sequence  {_describe(info['tokens_per_sequence'])}",
              f"  tokens/sample    {_describe(info['tokens_per_sample'])}"]
    if "views" in info:
        lines.append(f"  views/sample     {_describe(info['views_per_sample'])}")
        lines.append(f"  elements/view    {_describe(info['elements_per_view'])}")
        kinds = "  ".join(f"{name} {k['count']:,} (loss {k['loss']:,}, cfg {k['enable_cfg']:,})"
                          for name, k in info["element_kinds"].items())
        lines.append(f"  elements         {kinds}")
        images = info["images"]
        if images["count"]:
            formats = ", ".join(f"{name} {n:,}" for name, n in images["formats"].items())
            modes = ", ".join(f"{name} {n:,}" for name, n in images["modes"].items())
            lines += [f"  images           formats {formats};  modes {modes}",
                      f"  image width      {_describe(images['width'])}",
                      f"  image height     {_describe(images['height'])}",
                      f"  image bytes      {_describe(images['bytes'])}"]
    for enc in info.get("encodings", []):
        lines.append(f"  encoding {enc['name']:<7} {enc['records']:,} {enc['modality']} records ({enc['store']}, "
                     f"{enc['dtype']}, {_human_bytes(enc['bytes'])}) of {enc['encoder']}")
    files = ", ".join(f"{name} {_human_bytes(size)}" for name, size in info["files"].items())
    lines.append(f"  files            {files}")
    return "\n".join(lines)


def _dataset_prefixes(paths: Sequence[str]) -> list[str]:
    """The datasets named on the command line: prefixes as given, or every dataset of each data YAML."""
    from mmidx.config import DataConfig

    prefixes = []
    for path in paths:
        if path.endswith((".yaml", ".yml")):
            config = DataConfig.from_yaml(path)
            prefixes += [prefix for group in config.groups for prefix in group.datasets]
        else:
            prefixes.append(dataset_prefix(path))
    return prefixes


def cmd_inspect(args: argparse.Namespace) -> int:
    from mmidx.checks import summary
    from mmidx.dataset import MMIDXDataset

    infos = [summary(MMIDXDataset(prefix)) for prefix in _dataset_prefixes(args.paths)]
    if args.json:
        print(json.dumps(infos[0] if len(infos) == 1 else infos, indent=1))
    else:
        print("\n\n".join(format_summary(info) for info in infos))
    return 0


def _verify_one(prefix: str, decode: bool) -> bool:
    """Verify one dataset, print its verdict; True when it is sound."""
    from mmidx import format as fmt
    from mmidx.checks import verify
    from mmidx.storage import is_remote

    try:
        problems = verify(prefix, decode=decode)
    except Exception as error:  # whatever the files hold: one line, never a traceback
        print(f"mmidx: {prefix}: verification stopped: {type(error).__name__}: {error}", file=sys.stderr)
        return False
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if len(problems) > 1:
        print(f"{prefix}: {len(problems)} problems found", file=sys.stderr)
    if problems:
        return False
    images = "every image decoded" if decode else "image headers probed"
    if not is_remote(prefix) and not fmt.file_path(prefix, "meta").exists():
        print(f"{prefix}: OK (structure only: a Megatron pair without mmidx metadata, so no checksum "
              "guards its bytes)")
    else:
        print(f"{prefix}: OK (checksums and structure verified, {images})")
    return True


def cmd_verify(args: argparse.Namespace) -> int:
    results = [_verify_one(prefix, args.decode) for prefix in _dataset_prefixes(args.paths)]
    return 0 if all(results) else 1


Commands = Any  # the object argparse's add_subparsers returns


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless it has none (None, False) or says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == ():
            return action.help or ""
        return super()._get_help_string(action) or ""


def add_command(commands: Commands, name: str, handler: Callable[[argparse.Namespace], int],
                help: str) -> argparse.ArgumentParser:
    """Register subcommand ``name``."""
    sub = commands.add_parser(name, help=help, description=help, epilog=EXIT_STATUSES,
                              formatter_class=HelpFormatter)
    sub.set_defaults(handler=handler, usage_error=sub.error)  # usage_error(message): usage, the line, exit 2
    return sub


PREFIX_HELP = "dataset prefix (path without .idx/.bin; a path to one of its files is accepted too)"
PATHS_HELP = "dataset prefixes (paths or URIs: s3://bucket/prefix), or data YAMLs (every dataset of every group)"


def cmd_fetch(args: argparse.Namespace) -> int:
    """``mmidx fetch``: copy a dataset from object storage to local disk, then verify the copy."""
    from mmidx.checks import verify
    from mmidx.storage import fetch_dataset

    local = fetch_dataset(args.uri, args.folder)
    problems = verify(local)
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"{local}: fetched from {args.uri} and verified (checksums and structure)")
    return 0


def _register_fetch(commands: Commands) -> None:
    sub = add_command(commands, "fetch", cmd_fetch,
                      "Copy a dataset from object storage (s3://bucket/prefix) into a local folder and verify it.")
    sub.add_argument("uri", help="the dataset's prefix in object storage")
    sub.add_argument("folder", help="local folder; the copy keeps the prefix's last name")


def _register_inspect_and_verify(commands: Commands) -> None:
    sub = add_command(commands, "inspect", cmd_inspect,
                      "Print counts, size statistics, element kinds, images and file sizes.")
    sub.add_argument("paths", nargs="+", metavar="PREFIX_OR_DATA_YAML", help=PATHS_HELP)
    sub.add_argument("--json", action="store_true",
                     help="print machine-readable JSON (one dataset: an object; several: a list)")
    sub = add_command(commands, "verify", cmd_verify,
                      "Recompute checksums and structural invariants, probe every image; exit 1 on any problem.")
    sub.add_argument("paths", nargs="+", metavar="PREFIX_OR_DATA_YAML", help=PATHS_HELP)
    sub.add_argument("--decode", action="store_true", help="also decode every stored image (slower)")


def _data_config(args: argparse.Namespace) -> Any:
    from mmidx.config import ModelGeometry, config_for

    overrides = {"seed": args.seed} if args.seed is not None else {}
    if args.max_latent_size is not None:
        overrides["geometry"] = ModelGeometry(max_latent_size=args.max_latent_size)
    return config_for([dataset_prefix(path) for path in args.config], **overrides)


def cmd_index(args: argparse.Namespace) -> int:
    if args.gpt:
        from mmidx.gpt import GPTTextDataset

        if args.seq_length is None:
            args.usage_error("--gpt needs --seq-length")
        from mmidx.dataset import MMIDXDataset

        prefixes = [dataset_prefix(prefix) for prefix in args.config]
        for prefix in prefixes:
            if (kind := MMIDXDataset(prefix).kind) != "text":
                print(f"mmidx: {prefix}: a {kind} dataset; index --gpt builds GPT samples of text datasets only "
                      "(use mmidx index without --gpt for the pack index)", file=sys.stderr)
                return 1
        where = f"cached in {args.cache_dir}" if args.cache_dir else "not cached"
        for prefix in prefixes:
            samples = GPTTextDataset(prefix, seq_length=args.seq_length, num_samples=args.num_samples,
                                     seed=1234 if args.seed is None else args.seed, cache_dir=args.cache_dir)
            print(f"{prefix}: {len(samples):,} GPT samples of {args.seq_length} tokens ({where})")
        return 0
    from mmidx.pack_index import build_pack_index

    index = build_pack_index(_data_config(args), num_samples=args.num_samples, cache_dir=args.cache_dir)
    if args.json:
        print(json.dumps(index.stats, indent=1))
        return 0
    stats = index.stats
    where = "(not cached)" if index.path is None else f"{index.path} ({'reused' if index.reused else 'built'})"
    print(f"pack index {where}")
    print(f"  samples {stats['samples']:,} ({', '.join(f'{k} {v:,}' for k, v in stats['groups'].items())})")
    print(f"  packs {stats['num_packs']:,}   tokens {stats['tokens']:,}   fill {stats['fill_vs_max']:.3f} of "
          f"max_num_tokens, {stats['fill_vs_expected']:.3f} of expected")
    print(f"  excluded (over max_num_tokens_per_sample) {stats['excluded']:,}   deferred {stats['deferred']:,}   "
          f"max deferral {stats['max_deferral']} packs   solo packs {stats['solo_packs']}")
    print(f"  built in {stats['build_seconds']} s")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from mmidx.build.report import counted
    from mmidx.pack_index import build_pack_index
    from mmidx.packing import PackBuilder
    from mmidx.show import render

    config = _data_config(args)
    index = build_pack_index(config, num_samples=args.num_samples, cache_dir=args.cache_dir)
    if not 0 <= args.pack < len(index):
        print(f"mmidx: pack {args.pack} out of range: the index has {len(index)} packs", file=sys.stderr)
        return 1
    batch = PackBuilder(config).build(args.pack, index.items(args.pack))
    render(batch, width=args.width, zoom_sample=args.zoom_sample, title=f"pack {args.pack}: ").save(args.output)
    print(f"{args.output}: pack {args.pack}, {counted(batch.sequence_length, 'token')} in "
          f"{counted(len(batch.sample_lens), 'sample')}")
    return 0


def _register_index_and_show(commands: Commands) -> None:
    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("config", nargs="+", help="a data.yaml, or dataset prefixes (one group each)")
        sub.add_argument("--num-samples", type=int,
                         help="samples drawn into the stream, from the groups by weight (default: the total of "
                              "all datasets' samples; not one epoch of each dataset unless the weights are "
                              "proportional to their sizes)")
        sub.add_argument("--cache-dir", help="folder of cached indices (default: build in memory)")
        sub.add_argument("--seed", type=int, help="override the config's seed")
        sub.add_argument("--max-latent-size", type=int, help="VAE latent grid side (BAGEL: 32, 64 to fine-tune)")

    sub = add_command(commands, "index", cmd_index,
                      "Build the pack index (or, with --gpt, Megatron GPT indices) and print its statistics.")
    common(sub)
    sub.add_argument("--gpt", action="store_true", help="build GPT sample indices of text datasets instead")
    sub.add_argument("--seq-length", type=int, help="GPT sequence length (with --gpt)")
    sub.add_argument("--json", action="store_true", help="print the statistics as JSON")
    sub = add_command(commands, "show", cmd_show, "Render a pack's layout above its attention mask to a PNG.")
    common(sub)
    sub.add_argument("--pack", type=int, default=0, help="pack number")
    sub.add_argument("-o", "--output", default="pack.png", help="PNG file to write")
    sub.add_argument("--width", type=int, default=1024, help="picture width in pixels")
    sub.add_argument("--zoom-sample", type=int,
                     help="position in the pack of the sample to zoom into (default: the one with the most splits)")


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = [-1]
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of worker counts (e.g. 0,1,2,4)")
    return counts


def cmd_bench(args: argparse.Namespace) -> int:
    from mmidx import bench

    # the worker counts are the user's choice and the report names the cores: torch's advice is noise here
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    config = _data_config(args)
    if bench.text_only(config):
        result = bench.bench_gpt([p for group in config.groups for p in group.datasets], seq_length=args.seq_length,
                                 samples=args.gpt_samples, workers=args.workers)
    else:
        result = bench.bench_packs(config, packs=args.packs, workers=args.workers, decode=args.decode,
                                   masks=args.masks, target_tokens_per_s=args.target_tokens_per_s,
                                   cache_dir=args.cache_dir, encodings=args.encodings)
    print(json.dumps(result, indent=1) if args.json else bench.format_report(result))
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from mmidx.sample_view import describe_sample, format_sample

    info = describe_sample(args.prefix, args.index, view=args.view, output_dir=args.output)
    print(json.dumps(info, indent=1) if args.json else format_sample(info))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mmidx.export import export

    report = export(args.prefix, args.to, args.output)
    print(report.summary())
    return 0


def _register_toolkit(commands: Commands) -> None:
    sub = add_command(commands, "bench", cmd_bench,
                      "Time the torch loader on this machine: packs/s, tokens/s, samples/s and MB/s per worker "
                      "count, a stage breakdown, and the cores a target tokens/s needs (GPT samples/s for text).")
    sub.add_argument("config", nargs="+", help="a data.yaml, or dataset prefixes (one group each)")
    sub.add_argument("--packs", type=int, default=20,
                     help="packs per worker count; the first is not timed")
    sub.add_argument("--workers", type=_worker_counts, default="0,1,2,4",
                     help="comma-separated DataLoader worker counts")
    sub.add_argument("--decode", choices=("loader", "device"), default="loader",
                     help="decode images in the loader workers, or ship encoded bytes and decode on the device")
    sub.add_argument("--masks", choices=("none", "dense", "flex"), default="flex",
                     help="attention masks built in the main process")
    sub.add_argument("--target-tokens-per-s", type=float, default=100_000,
                     help="tokens/s the loader must feed, for the cores-needed line")
    sub.add_argument("--seq-length", type=int, default=2048,
                     help="GPT sample length, for text datasets")
    sub.add_argument("--gpt-samples", type=int, default=2000,
                     help="GPT samples per worker count, for text datasets")
    sub.add_argument("--cache-dir", help="folder of cached indices (default: build in memory)")
    sub.add_argument("--encodings", metavar="NAME",
                     help="a precached VAE encoding (mmidx precache): also time packs with its latents, against pixels")
    sub.add_argument("--json", action="store_true", help="print the results as JSON")
    sub.set_defaults(num_samples=None, seed=None, max_latent_size=None)
    sub = add_command(commands, "sample", cmd_sample,
                      "Show one sample as a person reads it: each element of a view, decoded texts, images, origin.")
    sub.add_argument("prefix", type=dataset_prefix, help=PREFIX_HELP)
    sub.add_argument("index", type=int, help="sample number")
    sub.add_argument("--view", type=int, default=0,
                     help="view number; epoch e reads view e mod views")
    sub.add_argument("-o", "--output", help="folder to write the sample's images to (default: none written)")
    sub.add_argument("--json", action="store_true", help="print machine-readable JSON")
    sub = add_command(commands, "export", cmd_export,
                      "Write a dataset back to a raw layout BAGEL reads (t2i/edit parquet, LLaVA JSONL + images) "
                      "or to WebDataset tars, with the original image bytes.")
    sub.add_argument("prefix", type=dataset_prefix, help=PREFIX_HELP)
    sub.add_argument("--to", required=True, choices=("parquet", "jsonl", "wds"), help="layout to write")
    sub.add_argument("output", help="folder to write (created; must not hold files already)")


def cmd_precache(args: argparse.Namespace) -> int:
    from mmidx.build.plan import BuildError
    from mmidx.encodings.precache import Job, precache

    job = Job(args.name, args.encoder, modality=args.modality, transform=args.transform, store=args.store,
              dtype=args.dtype, batch_size=args.batch_size, weights_version=args.weights_version)
    try:
        metas = precache(args.path, job, device=args.device, workers=args.workers, progress=not args.quiet,
                         engine=args.engine, ray_address=args.ray_address)
    except BuildError as error:  # another precache holds the output's lock
        print(f"mmidx precache: {error}", file=sys.stderr)
        return 1
    for meta in metas:
        print(f"{meta['name']}: {meta['counts']['records']} {meta['modality']} encodings ({meta['store']}, "
              f"{meta['dtype']}) of dataset {meta['dataset']['checksum'][:12]}")
    return 0


def _register_precache(commands: Commands) -> None:
    sub = add_command(commands, "precache", cmd_precache,
                      "Run a frozen encoder once over every image (or text) of the datasets and store its outputs "
                      "beside them (P.enc.NAME.*); packs then carry padded_latent instead of padded_images.")
    sub.add_argument("path", metavar="PREFIX_OR_DATA_YAML", help="a dataset prefix or a data YAML")
    sub.add_argument("--encoder", required=True, help="pkg.module:factory; factory() returns the frozen encoder")
    sub.add_argument("--name", required=True, help="the encoding's name (letters, digits, _ and -)")
    sub.add_argument("--modality", choices=("image", "text"), default="image", help="what the encoder reads")
    sub.add_argument("--transform", choices=("vae", "vit"), default="vae",
                     help="which of the group's transforms (and element kind) feeds the encoder")
    sub.add_argument("--store", choices=("moments", "mean", "sample"), default="moments",
                     help="what to keep of a (mean, logvar) output; a single tensor is stored as is")
    sub.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="stored dtype")
    sub.add_argument("--device", default="cpu", help="where the encoder runs (cpu, cuda, cuda:1)")
    sub.add_argument("--batch-size", type=int, default=16, help="images (texts) per encoder call, of one shape")
    sub.add_argument("--workers", type=int, default=1,
                     help="local: threads decoding and transforming images; ray: encoder actors (one GPU each "
                          "with --device cuda)")
    sub.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="where the encoder runs: this process, or actors of a Ray cluster (pip install "
                          "\"mmidx[ray]\"; the dataset must be readable there); the streams are the same")
    sub.add_argument("--ray-address", help="Ray cluster to join (default: RAY_ADDRESS, else a new local one)")
    sub.add_argument("--weights-version", help="a version or hash of the encoder's weights, recorded")
    sub.add_argument("--quiet", action="store_true", help="no progress line")


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part for part in value.split(",") if part)


def _source_options(args: argparse.Namespace) -> Any:
    from mmidx.cli_urls import url_source_options
    from mmidx.sources import SourceOptions

    return SourceOptions(
        views=args.views, seed=args.seed, image_root=args.image_root, max_image_size=args.max_image_size,
        max_image_pixels=args.max_image_pixels, min_frames=args.min_frames, max_frames=args.max_frames,
        frame_quality=args.video_frame_quality, text_key=args.text_key, extra_keys=args.extra_keys,
        prompt_key=args.prompt_key, caption_key=args.caption_key, rows_per_shard=args.rows_per_shard,
        bytes_per_shard=args.bytes_per_shard, **url_source_options(args))


def _os_error_line(error: OSError) -> str:
    """An OSError as one line: the path and the cause (disk full, read-only, permission denied...)."""
    if error.filename is None:
        return str(error.strerror or error)
    return f"{error.filename}: {error.strerror or error}"


def cmd_build(args: argparse.Namespace) -> int:
    """``mmidx build``: one source into one dataset, or every group of a BAGEL data config."""
    from mmidx.build import BuildError, BuildOptions, build_dataset, build_from_config
    from mmidx.sources import SourceError
    from mmidx.tokenizer import TokenizerError

    single = (args.source, args.input, args.output)
    multi = (args.config, args.dataset_info, args.output_dir)
    if not (all(single) and not any(multi)) and not (all(multi) and not any(single)):
        args.usage_error("give either --source, --input and --output, or --config, --dataset-info and --output-dir")
    from mmidx.cli_urls import max_skip_rate

    settings = {"tokenizer": args.tokenizer, "workers": args.workers, "max_skip_rate": max_skip_rate(args),
                "progress": not args.quiet, "engine": args.engine, "ray_address": args.ray_address,
                "force": args.force or args.retry_failed}  # a retry replaces the build it retries
    try:
        if all(single):
            reports = [build_dataset(BuildOptions(args.source, tuple(args.input), output=args.output,
                                                  source_options=_source_options(args), num_nodes=args.num_nodes,
                                                  node_rank=args.node_rank, **settings))]
        elif args.num_nodes != 1:
            args.usage_error("--num-nodes builds one --source/--input/--output; split a --config build by giving "
                             "each node its own groups")
        else:
            reports = build_from_config(args.config, args.dataset_info, args.output_dir,
                                        source_options=_source_options(args), **settings)
    except (BuildError, SourceError, TokenizerError, ValueError) as error:
        print(f"mmidx build: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"mmidx build: {_os_error_line(error)}", file=sys.stderr)
        return 1
    for report in reports:
        print(report.summary())
    return 0 if all(report.ok for report in reports) else 1


def _register_build(commands: Commands) -> None:
    from mmidx.cli_urls import add_url_arguments
    from mmidx.sources import SOURCE_NAMES, SourceOptions

    defaults = SourceOptions()
    sub = add_command(commands, "build", cmd_build,
                      "Build an mmidx dataset from raw sources (t2i/edit parquet, VLM/chat/text JSONL, RL prompt "
                      "files, WebDataset tars, URL tables downloaded while building), or every group of a BAGEL "
                      "data config.")
    sub.add_argument("--source", choices=SOURCE_NAMES, help="the kind of input")
    sub.add_argument("--input", nargs="+", action="extend", help="input files or folders (local or pyarrow URIs)")
    sub.add_argument("--output", type=dataset_prefix,
                     help="output dataset prefix (a report goes to PREFIX.report.json)")
    sub.add_argument("--config", help="BAGEL data config (data/configs/*.yaml shape)")
    sub.add_argument("--dataset-info", help="YAML mapping group → dataset name → data_dir / jsonl_path")
    sub.add_argument("--output-dir", help="folder for the datasets of --config and their data.yaml")
    sub.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory or cached name")
    sub.add_argument("--views", type=int, default=defaults.views, help="views (augmentations) per sample")
    sub.add_argument("--workers", type=int, default=1,
                     help="worker processes (--engine ray: CPUs of the local cluster it starts)")
    sub.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="run the work units in local processes or as tasks of a Ray cluster (pip install "
                          "\"mmidx[ray]\")")
    sub.add_argument("--ray-address", help="Ray cluster to join (default: RAY_ADDRESS, else a new local one)")
    sub.add_argument("--num-nodes", type=int, default=1,
                     help="split the units over this many nodes; each builds its share, then mmidx merge")
    sub.add_argument("--node-rank", type=int, default=0, help="this node's number in 0..num-nodes-1")
    sub.add_argument("--seed", type=int, default=defaults.seed, help="seed of every random draw")
    sub.add_argument("--image-root", help="folder that image and video names in JSONL rows are relative to")
    sub.add_argument("--max-image-size", "--max-image-side", type=int,
                     help="downsize and re-encode images whose long edge is larger (lossy; recorded)")
    sub.add_argument("--max-image-pixels", type=int,
                     help="refuse images with more pixels (decompression bombs; default 2^27)")
    sub.add_argument("--max-skip-rate", type=float,
                     help="fail when a larger fraction of the rows is skipped (default 0.01; --source urls: 1.0)")
    sub.add_argument("--min-frames", type=int, default=defaults.min_frames, help="fewest frames drawn per video")
    sub.add_argument("--max-frames", type=int, default=defaults.max_frames, help="most frames drawn per video")
    sub.add_argument("--video-frame-quality", type=int, metavar="Q",
                     help="store video frames as JPEG of quality Q (1-100), smaller but lossy; default: lossless")
    sub.add_argument("--text-key", default=defaults.text_key, help="JSON field of a text document")
    sub.add_argument("--extra-keys", type=_csv, default=(),
                     help="chat: comma-separated fields placed before the conversation, without loss")
    sub.add_argument("--prompt-key", default=defaults.prompt_key, help="prompts: JSON field of the prompt")
    sub.add_argument("--caption-key", default=defaults.caption_key, help="wds: caption field of .json members")
    sub.add_argument("--rows-per-shard", type=int, default=defaults.rows_per_shard,
                     help="parquet rows per work unit (row groups are never split)")
    sub.add_argument("--bytes-per-shard", type=int, default=defaults.bytes_per_shard,
                     help="JSONL bytes per work unit (cut at line starts)")
    sub.add_argument("--quiet", action="store_true", help="no progress bar")
    sub.add_argument("--force", action="store_true",
                     help="replace a dataset at the output built from other inputs or options (a rerun with the "
                          "same ones reuses it, or what a killed run finished, without it)")
    add_url_arguments(sub)


def cmd_merge(args: argparse.Namespace) -> int:
    """``mmidx merge``: the shard folders of a build split over nodes, or whole datasets, into one."""
    from mmidx.build import BuildError, merge_into

    try:
        report = merge_into(args.output, args.input, max_skip_rate=args.max_skip_rate)
    except (BuildError, ValueError) as error:
        print(f"mmidx merge: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"mmidx merge: {_os_error_line(error)}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0 if report.ok else 1


def _register_merge(commands: Commands) -> None:
    sub = add_command(commands, "merge", cmd_merge,
                      "Merge the shard folders (OUTPUT.shards) of a build split with --num-nodes, named in any "
                      "order, into its dataset; or concatenate whole datasets of one kind and tokenizer.")
    sub.add_argument("output", type=dataset_prefix, help="output dataset prefix")
    sub.add_argument("input", nargs="+", type=dataset_prefix, help="shard folders of one build, or dataset prefixes")
    sub.add_argument("--max-skip-rate", type=float,
                     help="shard folders: fail when a larger fraction of the rows was skipped (default 0.01; "
                          "--source urls: 1.0)")


def cmd_demo(args: argparse.Namespace) -> int:
    from mmidx.demo import format_summary, run

    result = run(args.workdir, quick=args.quick, progress=functools.partial(print, flush=True))
    print(format_summary(result))
    return 0 if not result["problems"] and all(r.ok for r in result["reports"]) else 1


def _register_demo(commands: Commands) -> None:
    sub = add_command(commands, "demo", cmd_demo,
                      "Generate BAGEL-style sample data, build, index and pack it, and print a summary.")
    sub.add_argument("--workdir", default="mmidx-demo", help="folder for the generated data and outputs")
    sub.add_argument("--quick", action="store_true", help="a smaller corpus (for tests)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmidx", description=__doc__.splitlines()[0], epilog=EXIT_STATUSES,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"mmidx {mmidx.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _register_inspect_and_verify(commands)
    _register_fetch(commands)
    _register_index_and_show(commands)
    _register_toolkit(commands)
    _register_build(commands)
    _register_merge(commands)
    _register_precache(commands)
    _register_demo(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every error ends in one line on stderr and exit status 1 (2: usage)."""
    import yaml

    args = build_parser().parse_args(argv)
    name = f"mmidx {args.command}"
    try:
        code = args.handler(args)
        sys.stdout.flush()  # a closed pipe is met here, not at exit where it could only be ignored noisily
        return code
    except BrokenPipeError:  # the reader went away (``| head``): nothing more to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except OSError as error:
        print(f"{name}: {_os_error_line(error)}", file=sys.stderr)
    except yaml.YAMLError as error:  # a malformed YAML file: its path and line are in the message
        print(f"{name}: not valid YAML: {' '.join(str(error).split())}", file=sys.stderr)
    except (FormatError, ValueError, KeyError, TypeError) as error:  # bad files or configuration: what, not where
        print(f"{name}: {error}", file=sys.stderr)
    except Exception as error:  # a bug: still one line, and how to see the rest
        if os.environ.get("MMIDX_TRACEBACK"):
            raise
        print(f"{name}: internal error {type(error).__name__}: {error} (set MMIDX_TRACEBACK=1 for the traceback)",
              file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
