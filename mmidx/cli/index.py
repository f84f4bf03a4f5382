"""``mmidx index`` and ``show``: build a pack or GPT index ahead of time; draw a pack's layout and masks.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mmidx.cli.common import Commands, add_command, dataset_prefix


def _data_config(args: argparse.Namespace) -> Any:
    from mmidx.config import ModelGeometry, config_for

    overrides = {"seed": args.seed} if args.seed is not None else {}
    if args.max_latent_size is not None:
        overrides["geometry"] = ModelGeometry(max_latent_size=args.max_latent_size)
    return config_for([dataset_prefix(path) for path in args.config], **overrides)


def cmd_index(args: argparse.Namespace) -> int:
    if args.gpt:
        from mmidx.train.gpt import GPTTextDataset

        if args.seq_length is None:
            args.usage_error("--gpt needs --seq-length")
        from mmidx.read.dataset import MMIDXDataset

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
            line = f"{prefix}: {len(samples):,} GPT samples of {args.seq_length} tokens ({where})"
            if args.num_samples is not None and len(samples) != args.num_samples:
                epochs = len(samples.document_index) // max(len(samples.dataset.tokens.sequence_lengths), 1)
                line += (f"; {args.num_samples:,} asked for: as Megatron's GPTDataset, the index covers whole "
                         f"epochs of the documents ({epochs} here), whose samples are all kept")
            print(line)
        return 0
    from mmidx.index.pack_index import build_pack_index

    config = _data_config(args)
    index = build_pack_index(config, num_samples=args.num_samples, cache_dir=args.cache_dir)
    gpu = _gpu_time(args, config)
    if args.json:
        print(json.dumps({**index.stats, **({"gpu_time": gpu} if gpu else {})}, indent=1))
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
    for policy, figures in (gpu or {}).items():
        mark = " (this config)" if policy == config.packing.policy else ""
        print(f"  {policy:5s}{mark}: fill_vs_max {figures['fill_vs_max']:.3f}   step_balance "
              f"{figures['step_balance']:.3f} (contiguous {figures['step_balance_contiguous']:.3f})   "
              f"gpu_efficiency {figures['gpu_efficiency']:.3f}   at world {args.world_size}, global batch "
              f"{args.global_batch_size}")
    return 0


def _gpu_time(args: argparse.Namespace, config: Any) -> dict[str, Any] | None:
    """The GPU-time report of both packing policies, with --world-size and --global-batch-size."""
    if args.world_size is None and args.global_batch_size is None:
        return None
    if args.world_size is None or args.global_batch_size is None:
        args.usage_error("--world-size and --global-batch-size go together")
    from mmidx.index.gpu_time import gpu_time_report

    return gpu_time_report(config, args.world_size, args.global_batch_size, num_samples=args.num_samples,
                           cache_dir=args.cache_dir)


def cmd_show(args: argparse.Namespace) -> int:
    from mmidx.index.pack_index import build_pack_index
    from mmidx.ingest.report import counted
    from mmidx.pack.builder import PackBuilder
    from mmidx.toolkit.show import render

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


def register(commands: Commands) -> None:
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
    sub.add_argument("--world-size", type=int, help="with --global-batch-size: report fill, step balance and GPU "
                                                     "efficiency of both packing policies at this world size")
    sub.add_argument("--global-batch-size", type=int, help="packs per optimizer step (a multiple of --world-size)")
    sub = add_command(commands, "show", cmd_show, "Render a pack's layout above its attention mask to a PNG.")
    common(sub)
    sub.add_argument("--pack", type=int, default=0, help="pack number")
    sub.add_argument("-o", "--output", default="pack.png", help="PNG file to write")
    sub.add_argument("--width", type=int, default=1024, help="picture width in pixels")
    sub.add_argument("--zoom-sample", type=int,
                     help="position in the pack of the sample to zoom into (default: the one with the most splits)")
