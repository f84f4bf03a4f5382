"""``mmidx build`` and ``merge``: raw sources (or a BAGEL data config) to datasets, and the shards of a
split build into one.
"""

from __future__ import annotations

import argparse
from typing import Any

from mmidx.cli.common import (
    EXIT_STATUSES,
    PREFIX,
    Commands,
    add_command,
    at_least,
    default_note,
    fraction,
    named_output,
    one_dataset,
    output_prefix,
    size_note,
)
from mmidx.cli.url_options import add_url_arguments, max_skip_rate, url_source_options
from mmidx.format import AUTO_SINGLE_BYTES, AUTO_SINGLE_UNITS, BUILD_LAYOUTS

# What each --source reads, in the help itself (a wheel install has no docs folder); a test keeps every source here.
INPUT_SCHEMAS = """input schemas (--source: files; what one row holds):

  t2i        .parquet: image (encoded bytes), captions ({"0": "a cat", ...})
  edit       .parquet: image_list (n >= 2 images), instruction_list (n-1 lists)
  vlm        .jsonl: LLaVA conversations + image(s) or video, under --image-root
  chat       .jsonl: conversations, and keys of --extra-keys or --chat-config
  text       .jsonl: a text field (--text-key)
  prompts    .txt (one a line), .jsonl, .json: prompt (--prompt-key) or caption
  wds        .tar, .tar.gz, .tgz: KEY.jpg (any image) + KEY.txt and/or KEY.json
  video_gen  .jsonl: video (file or frames folder/), caption, condition_frames
  hf         .parquet, .arrow, save_to_disk: image + captions, or conversations
  urls       .parquet, .csv, .tsv, .jsonl (each also .gz): URL + caption columns

Images with a captions file, or any other layout: a Python function over your inputs, built by mmidx.write
(help(mmidx.write))."""


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part for part in value.split(",") if part)


def _source_options(args: argparse.Namespace) -> Any:
    from mmidx.sources import SourceOptions

    return SourceOptions(
        views=args.views, seed=args.seed, image_root=args.image_root, max_image_size=args.max_image_size,
        max_image_pixels=args.max_image_pixels, max_text_tokens=args.max_text_tokens, min_frames=args.min_frames,
        max_frames=args.max_frames,
        frame_quality=args.video_frame_quality, text_key=args.text_key, extra_keys=args.extra_keys,
        chat_config=_chat_config(args),
        prompt_key=args.prompt_key, caption_key=args.caption_key, group_decay=args.group_decay,
        grouping=not args.no_grouping, image_column=args.image_column, caption_columns=args.caption_column,
        keep_columns=args.keep_columns, split=args.split, rows_per_shard=args.rows_per_shard,
        bytes_per_shard=args.bytes_per_shard, **url_source_options(args))


def _chat_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The checked chat config of ``--chat-config`` (None without one; a bad one is a ChatConfigError's line)."""
    if args.chat_config is None:
        return None
    from mmidx.sources.chat_config import load_chat_config

    if args.source != "chat":
        args.usage_error("--chat-config configures --source chat")
    if args.extra_keys:
        args.usage_error("--extra-keys and --chat-config both order the prompt: list the keys in the chat "
                         "config's message_construction")
    return load_chat_config(args.chat_config)


def cmd_build(args: argparse.Namespace) -> int:
    """``mmidx build``: one source into one dataset, or every group of a BAGEL data config."""
    from mmidx.ingest import BuildOptions, build_dataset, build_from_config

    single = (args.source, args.input, args.output)
    multi = (args.config, args.dataset_info, args.output_dir)
    if not (all(single) and not any(multi)) and not (all(multi) and not any(single)):
        args.usage_error("give either --source, --input and --output, or --config, --dataset-info and --output-dir")
    settings = {"tokenizer": args.tokenizer, "workers": args.workers, "max_skip_rate": max_skip_rate(args),
                "progress": not args.quiet, "engine": args.engine, "ray_address": args.ray_address,
                "force": args.force or args.retry_failed,  # a retry replaces the build it retries
                "layout": args.layout}
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
    from mmidx.images.decode import DEFAULT_MAX_PIXELS
    from mmidx.sources import SOURCE_NAMES, SourceOptions

    defaults = SourceOptions()
    sub = add_command(commands, "build", cmd_build,
                      "Build an mmidx dataset from raw sources (t2i/edit parquet, VLM/chat/text JSONL, RL prompt "
                      "files, WebDataset tars, Hugging Face datasets, URL tables downloaded while building), or every "
                      "group of a BAGEL data config. Each source's input schema: at the end of this help.")
    sub.epilog = f"{INPUT_SCHEMAS}\n\n{EXIT_STATUSES}"
    what = sub.add_argument_group("what to build", "--source, --input and --output; or --config, --dataset-info "
                                                   "and --output-dir")
    what.add_argument("--source", choices=SOURCE_NAMES, metavar="SOURCE",
                      help=f"the kind of input: {', '.join(SOURCE_NAMES)}")
    what.add_argument("--input", nargs="+", action="extend", metavar="PATH",
                      help="input files or folders (local or pyarrow URIs)")
    what.add_argument("--output", type=output_prefix, metavar=PREFIX,
                      help="output dataset prefix (a report goes to PREFIX.report.json)")
    what.add_argument("--config", metavar="BAGEL_YAML", help="BAGEL data config (data/configs/*.yaml shape)")
    what.add_argument("--dataset-info", metavar="INFO_YAML",
                      help="YAML mapping group → dataset name → data_dir / jsonl_path")
    what.add_argument("--output-dir", metavar="FOLDER", help="folder for the datasets of --config and their data.yaml")
    what.add_argument("--tokenizer", required=True, metavar="TOKENIZER",
                      help="tokenizer folder (save_pretrained), tokenizer.json file, or Hugging Face org/name id "
                           "(cached, or fetched online)")
    run = sub.add_argument_group("how it runs")
    run.add_argument("--workers", type=at_least(1), default=1,
                     help="worker processes (--engine ray: CPUs of the local cluster it starts)")
    run.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="run the work units in local processes or as tasks of a Ray cluster (pip install "
                          "\"mmidx[ray]\")")
    run.add_argument("--ray-address", help=default_note("Ray cluster to join", "RAY_ADDRESS, else a new local one"))
    run.add_argument("--num-nodes", type=at_least(1), default=1,
                     help="split the units over this many nodes; each builds its share, then mmidx merge")
    run.add_argument("--node-rank", type=at_least(0), default=0, help="this node's number in 0..num-nodes-1")
    run.add_argument("--max-skip-rate", type=fraction,
                     help=default_note("fail when a larger fraction of the rows is skipped",
                                       "0.01; --source urls: 1.0"))
    run.add_argument("--rows-per-shard", type=at_least(1), default=defaults.rows_per_shard,
                     help="parquet rows per work unit (row groups are never split)")
    run.add_argument("--bytes-per-shard", type=at_least(1), default=defaults.bytes_per_shard,
                     help=default_note("JSONL bytes per work unit (cut at line starts)",
                                       size_note(defaults.bytes_per_shard, "bytes")))
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--force", action="store_true",
                     help="replace a dataset at the output built from other inputs or options (a rerun with the "
                          "same ones reuses it, or what a killed run finished, without it)")
    _layout_argument(run)
    samples = sub.add_argument_group("samples, images and video (every source with images)")
    samples.add_argument("--views", type=at_least(1), default=defaults.views, help="views (augmentations) per sample")
    samples.add_argument("--seed", type=int, default=defaults.seed, help="seed of every random draw")
    samples.add_argument("--image-root", metavar="FOLDER",
                         help="folder that image and video names in JSONL rows are relative to")
    samples.add_argument("--max-image-size", type=at_least(1), metavar="PIXELS",
                         help="downsize and re-encode images whose long edge is larger (lossy; recorded)")
    samples.add_argument("--max-image-side", type=at_least(1), dest="max_image_size", help=argparse.SUPPRESS)
    samples.add_argument("--max-image-pixels", type=at_least(1), metavar="PIXELS",
                         help=default_note("refuse images with more pixels (decompression bombs)",
                                           size_note(DEFAULT_MAX_PIXELS, "pixels")))
    samples.add_argument("--max-text-tokens", type=at_least(1), default=defaults.max_text_tokens, metavar="N",
                         help="skip rows with a text longer than N tokens (counted as text_too_long)")
    samples.add_argument("--min-frames", type=at_least(1), default=defaults.min_frames,
                         help="fewest frames drawn per video")
    samples.add_argument("--max-frames", type=at_least(1), default=defaults.max_frames,
                         help="most frames drawn per video")
    samples.add_argument("--video-frame-quality", type=at_least(1), metavar="Q",
                         help=default_note("store video frames as JPEG of quality Q (1-100), smaller but lossy",
                                           "lossless"))
    jsonl = sub.add_argument_group("JSONL sources (text, chat, prompts, video_gen) and WebDataset (wds)")
    jsonl.add_argument("--text-key", default=defaults.text_key, help="text: JSON field of a text document")
    jsonl.add_argument("--extra-keys", type=_csv, default=(), metavar="KEY[,KEY...]",
                       help="chat: comma-separated fields placed before the conversation, without loss")
    jsonl.add_argument("--chat-config", metavar="CHAT_YAML",
                       help="chat: YAML of special_tokens, loss_masking_jq_patterns, message_construction and "
                            "eos_after, which decide the training text (each key: python -m pydoc "
                            "mmidx.sources.chat_config)")
    jsonl.add_argument("--prompt-key", default=defaults.prompt_key, help="prompts: JSON field of the prompt")
    jsonl.add_argument("--caption-key", default=defaults.caption_key,
                       help="wds: caption field of .json members; video_gen: caption field of a row")
    jsonl.add_argument("--group-decay", type=float, default=defaults.group_decay, metavar="D",
                       help="video_gen: split_integer_exp_decay's decay in [0, 1] (1.0: group count uniform in "
                            "1..frames, below: fewer groups preferred)")
    jsonl.add_argument("--no-grouping", action="store_true",
                       help="video_gen: the target frames of a clip are one split, as BAGEL's _add_video writes them")
    hf = sub.add_argument_group("Hugging Face datasets (hf) and URL tables (urls)")
    hf.add_argument("--image-column", metavar="COLUMN",
                    help=default_note("hf: the image (or image list) column", "image, else images"))
    hf.add_argument("--caption-column", type=_csv, default=(), metavar="COLUMN[,COLUMN...]",
                    help="hf: caption column(s), each cell a string, list or struct of strings, or BAGEL's JSON "
                         "object of captions (default: the first of captions, caption, text, texts); urls: the "
                         "caption column, a string or BAGEL's JSON object of captions (default: caption; LAION: "
                         "TEXT)")
    hf.add_argument("--keep-columns", type=_csv, default=(), metavar="COLUMN[,COLUMN...]",
                    help="hf, urls: comma-separated columns kept with each sample (its extra JSON)")
    hf.add_argument("--split", help="hf: the split of a DatasetDict folder or of parquet files in the hub's layout")
    add_url_arguments(sub)


def cmd_merge(args: argparse.Namespace) -> int:
    """``mmidx merge``: the shard folders of a build split over nodes, or whole datasets, into one."""
    from mmidx.ingest import merge_into

    inputs, first = args.input, None
    if args.output is None and len(inputs) > 1:  # the deprecated form: the output first, then the inputs
        first, inputs = inputs[0], inputs[1:]
    output = named_output(args, first, "the output first (mmidx merge OUTPUT INPUT...)")
    report = merge_into(output, inputs, max_skip_rate=args.max_skip_rate, force=args.force, layout=args.layout)
    print(report.summary())
    return 0 if report.ok else 1


def _register_merge(commands: Commands) -> None:
    sub = add_command(commands, "merge", cmd_merge,
                      "Merge the shards of a build split with --num-nodes (each node's --output prefix, or its "
                      "PREFIX.shards folder), named in any order, into its dataset; or concatenate whole datasets "
                      "of one kind and tokenizer. --output names the dataset written; one already there is replaced "
                      "only with --force, unless it is this merge's result.")
    sub.add_argument("input", nargs="+", type=one_dataset, metavar="PREFIX_OR_SHARDS",
                     help="the prefixes (or shard folders) each node of one build wrote, or dataset prefixes")
    sub.add_argument("-o", "--output", type=output_prefix, metavar=PREFIX,
                     help="the dataset to write (a report goes to PREFIX.report.json); the old form that gave it "
                          "first, mmidx merge OUTPUT INPUT..., is deprecated")
    sub.add_argument("--force", action="store_true",
                     help="replace a dataset at the output that is not this merge's result (a rerun of the same "
                          "merge reuses its result without it)")
    sub.add_argument("--max-skip-rate", type=fraction,
                     help=default_note("shard folders: fail when a larger fraction of the rows was skipped",
                                       "0.01; --source urls: 1.0"))
    _layout_argument(sub, "shard folders: ")


def _layout_argument(group: Any, which: str = "") -> None:
    group.add_argument("--layout", choices=BUILD_LAYOUTS, default="auto",
                       help=default_note(f"{which}how the build ends: single merges the shards into one set of files "
                                         "(one Megatron .idx/.bin pair), sharded keeps them under a table (seconds, "
                                         "whatever the size)", f"auto: single up to {AUTO_SINGLE_UNITS} units and "
                                         f"{AUTO_SINGLE_BYTES >> 30} GiB of data, sharded beyond"))


def register(commands: Commands) -> None:
    """Add this module's commands to the parser."""
    _register_build(commands)
    _register_merge(commands)
