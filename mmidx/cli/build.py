"""``mmidx build`` and ``merge``: raw sources (or a BAGEL data config) to datasets, and the shards of a
split build into one.
"""

from __future__ import annotations

import argparse
from typing import Any

from mmidx.cli.common import Commands, add_command, dataset_prefix
from mmidx.cli.url_options import add_url_arguments, max_skip_rate, url_source_options


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part for part in value.split(",") if part)


def _source_options(args: argparse.Namespace) -> Any:
    from mmidx.sources import SourceOptions

    return SourceOptions(
        views=args.views, seed=args.seed, image_root=args.image_root, max_image_size=args.max_image_size,
        max_image_pixels=args.max_image_pixels, max_text_tokens=args.max_text_tokens, min_frames=args.min_frames,
        max_frames=args.max_frames,
        frame_quality=args.video_frame_quality, text_key=args.text_key, extra_keys=args.extra_keys,
        prompt_key=args.prompt_key, caption_key=args.caption_key, group_decay=args.group_decay,
        grouping=not args.no_grouping, image_column=args.image_column, caption_columns=args.caption_column,
        keep_columns=args.keep_columns, split=args.split, rows_per_shard=args.rows_per_shard,
        bytes_per_shard=args.bytes_per_shard, **url_source_options(args))


def cmd_build(args: argparse.Namespace) -> int:
    """``mmidx build``: one source into one dataset, or every group of a BAGEL data config."""
    from mmidx.ingest import BuildOptions, build_dataset, build_from_config

    single = (args.source, args.input, args.output)
    multi = (args.config, args.dataset_info, args.output_dir)
    if not (all(single) and not any(multi)) and not (all(multi) and not any(single)):
        args.usage_error("give either --source, --input and --output, or --config, --dataset-info and --output-dir")
    settings = {"tokenizer": args.tokenizer, "workers": args.workers, "max_skip_rate": max_skip_rate(args),
                "progress": not args.quiet, "engine": args.engine, "ray_address": args.ray_address,
                "force": args.force or args.retry_failed}  # a retry replaces the build it retries
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
    for report in reports:
        print(report.summary())
    return 0 if all(report.ok for report in reports) else 1


def _register_build(commands: Commands) -> None:
    from mmidx.sources import SOURCE_NAMES, SourceOptions

    defaults = SourceOptions()
    sub = add_command(commands, "build", cmd_build,
                      "Build an mmidx dataset from raw sources (t2i/edit parquet, VLM/chat/text JSONL, RL prompt "
                      "files, WebDataset tars, Hugging Face datasets, URL tables downloaded while building), or every "
                      "group of a BAGEL data config.")
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
    sub.add_argument("--max-text-tokens", type=int, default=defaults.max_text_tokens, metavar="N",
                     help="skip rows with a text longer than N tokens (counted as text_too_long; default "
                          f"{defaults.max_text_tokens:,})")
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
    sub.add_argument("--caption-key", default=defaults.caption_key,
                     help="wds: caption field of .json members; video_gen: caption field of a row")
    sub.add_argument("--group-decay", type=float, default=defaults.group_decay, metavar="D",
                     help="video_gen: split_integer_exp_decay's decay in [0, 1] (1.0: group count uniform in "
                          "1..frames, below: fewer groups preferred)")
    sub.add_argument("--no-grouping", action="store_true",
                     help="video_gen: the target frames of a clip are one split, as BAGEL's _add_video writes them")
    sub.add_argument("--image-column", help="hf: the image (or image list) column (default: image, else images)")
    sub.add_argument("--caption-column", type=_csv, default=(), metavar="COLUMN[,COLUMN...]",
                     help="hf: caption column(s), each cell a string, list or struct of strings (default: the first "
                          "of captions, caption, text, texts); urls: the caption column, a string or BAGEL's JSON "
                          "object of captions (default: caption; LAION: TEXT)")
    sub.add_argument("--keep-columns", type=_csv, default=(),
                     help="hf, urls: comma-separated columns kept with each sample (its extra JSON)")
    sub.add_argument("--split", help="hf: the split of a DatasetDict folder or of parquet files in the hub's layout")
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
    from mmidx.ingest import merge_into

    report = merge_into(args.output, args.input, max_skip_rate=args.max_skip_rate)
    print(report.summary())
    return 0 if report.ok else 1


def _register_merge(commands: Commands) -> None:
    sub = add_command(commands, "merge", cmd_merge,
                      "Merge the shards of a build split with --num-nodes (each node's --output prefix, or its "
                      "PREFIX.shards folder), named in any order, into its dataset; or concatenate whole datasets "
                      "of one kind and tokenizer.")
    sub.add_argument("output", type=dataset_prefix, help="output dataset prefix")
    sub.add_argument("input", nargs="+", type=dataset_prefix,
                     help="the prefixes (or shard folders) each node of one build wrote, or dataset prefixes")
    sub.add_argument("--max-skip-rate", type=float,
                     help="shard folders: fail when a larger fraction of the rows was skipped (default 0.01; "
                          "--source urls: 1.0)")


def register(commands: Commands) -> None:
    """Add this module's commands to the parser."""
    _register_build(commands)
    _register_merge(commands)
