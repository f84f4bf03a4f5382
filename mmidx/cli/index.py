"""``mmidx index`` and ``show``: build a pack or GPT index ahead of time; draw a pack's layout and masks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from mmidx.cli.common import Commands, add_command, add_pack_arguments, at_least, dataset_prefix, geometry_args


def _data_config(args: argparse.Namespace) -> Any:
    """The data config of the arguments, or with --history the run's mixture history (a MixtureHistory)."""
    from mmidx.config import config_for

    if getattr(args, "history", None) is not None:  # mmidx bench shares this without --history
        from mmidx.index.history import MixtureHistory

        if args.config or args.seed is not None or geometry_args(args):
            args.usage_error("--history holds the run's configs: give no config, --seed or geometry options")
        return MixtureHistory.load(args.history)
    if not args.config:
        args.usage_error("give a data.yaml, dataset prefixes, or --history")
    overrides = {"seed": args.seed} if args.seed is not None else {}
    return config_for([dataset_prefix(path) for path in args.config], geometry_args(args), **overrides)


def cmd_index(args: argparse.Namespace) -> int:
    if args.gpt:
        from mmidx.train.gpt import GPTTextDataset

        if args.seq_length is None or not args.config:
            args.usage_error("--gpt needs --seq-length and text dataset prefixes")
        from mmidx.read.dataset import MMIDXDataset

        prefixes = [dataset_prefix(prefix) for prefix in args.config]
        for prefix in prefixes:
            if (kind := MMIDXDataset(prefix).kind) != "text":
                print(f"mmidx index: {prefix}: a {kind} dataset; index --gpt builds GPT samples of text datasets only "
                      "(use mmidx index without --gpt for the pack index)", file=sys.stderr)
                return 1
        where = f"cached in {args.cache_dir}" if args.cache_dir else "not cached"
        for prefix in prefixes:
            samples = GPTTextDataset(prefix, seq_length=args.seq_length, num_samples=args.num_samples,
                                     seed=1234 if args.seed is None else args.seed, cache_dir=args.cache_dir)
            line = f"{prefix}: {len(samples):,} GPT samples of {args.seq_length} tokens ({where})"
            if args.num_samples is not None and len(samples) != args.num_samples:
                epochs = len(samples.document_index) // max(samples.sequences.count, 1)
                line += (f"; {args.num_samples:,} asked for: as Megatron's GPTDataset, the index covers whole "
                         f"epochs of the documents ({epochs} here), whose samples are all kept")
            print(line)
        return 0
    from mmidx.index.pack_index import build_pack_index
    from mmidx.ingest.report import counted

    config = _data_config(args)
    if args.world_size is not None and getattr(args, "history", None) is not None:
        args.usage_error("--world-size reports on one config: give the data.yaml, not --history")
    index = build_pack_index(config, num_samples=args.num_samples, cache_dir=args.cache_dir)
    if args.mixture:
        from mmidx.index.mixture import mixture_report

        report = mixture_report(index)
        print(json.dumps(report, indent=1) if args.json else _mixture_text(report))
        return 0
    gpu = _gpu_time(args, config, index)
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
          f"max deferral {counted(stats['max_deferral'], 'pack')}   solo packs {stats['solo_packs']}")
    print(f"  built in {stats['build_seconds']} s")
    for policy, figures in (gpu or {}).items():
        mark = " (this config)" if policy == config.packing.policy else ""
        print(f"  {policy:5s}{mark}: fill_vs_max {figures['fill_vs_max']:.3f}   step_balance "
              f"{figures['step_balance']:.3f} (contiguous {figures['step_balance_contiguous']:.3f})   "
              f"gpu_efficiency {figures['gpu_efficiency']:.3f}   at world {args.world_size}, global batch "
              f"{args.global_batch_size}")
    return 0


def _mixture_text(report: dict[str, Any]) -> str:
    """``mmidx index --mixture``'s table: per phase and group, then each group's epochs."""
    lines = [f"mixture over {report['packs']:,} packs ({report['excluded']:,} samples excluded, over "
             "max_num_tokens_per_sample)"]
    for phase in report["phases"]:
        until = ", ".join(f"until {k} {v:,}" for k, v in phase["until"].items()) or "open-ended"
        lines.append(f"phase {phase['phase']}: packs [{phase['packs'][0]:,}, {phase['packs'][1]:,}) ({until})")
        lines.append(f"  {'group':<24}{'samples':>12}{'tokens':>16}{'share':>9}{'weight':>9}")
        for name, group in phase["groups"].items():
            lines.append(f"  {name:<24}{group['samples']:>12,}{group['tokens']:>16,}{group['share']:>9.2%}"
                         f"{group['weight']:>9.2%}")
    lines.append("epochs (pack at which each ended)")
    for name, epochs in report["epochs"].items():
        ended = ", ".join(f"{pack:,}" for pack in epochs["ended_at_pack"]) or "-"
        lines.append(f"  {name}: {epochs['taken']:,} of {epochs['samples']:,} samples taken, "
                     f"{epochs['completed']} epochs completed: {ended}")
    return "\n".join(lines)


def _gpu_time(args: argparse.Namespace, config: Any, index: Any) -> dict[str, Any] | None:
    """The GPU-time report of both packing policies, with --world-size and --global-batch-size (``index``: the
    config's, built already)."""
    if args.world_size is None and args.global_batch_size is None:
        return None
    if args.world_size is None or args.global_batch_size is None:
        args.usage_error("--world-size and --global-batch-size go together")
    from mmidx.index.gpu_time import gpu_time_report

    return gpu_time_report(config, args.world_size, args.global_batch_size, num_samples=args.num_samples,
                           cache_dir=args.cache_dir, index=index)


def cmd_show(args: argparse.Namespace) -> int:
    from mmidx.index.pack_index import build_pack_index
    from mmidx.ingest.report import counted
    from mmidx.pack.builder import PackBuilder
    from mmidx.toolkit.show import render

    _check_picture_path(args)
    index = build_pack_index(_data_config(args), num_samples=args.num_samples, cache_dir=args.cache_dir)
    config = index.config
    if not 0 <= args.pack < len(index):
        print(f"mmidx show: pack {args.pack} out of range: the index has {counted(len(index), 'pack')}",
              file=sys.stderr)
        return 1
    batch = PackBuilder(config).build(args.pack, index.items(args.pack))
    render(batch, width=args.width, zoom_sample=args.zoom_sample, title=f"pack {args.pack}: ").save(args.output)
    print(f"{args.output}: pack {args.pack}, {counted(batch.sequence_length, 'token')} in "
          f"{counted(len(batch.sample_lens), 'sample')}{_dropped(config, args.pack, index, batch.sequence_length)}")
    return 0


def _check_picture_path(args: argparse.Namespace) -> None:
    """``-o`` names a picture file of a format PIL writes (known by its extension), before any work is done."""
    from PIL import Image

    output = args.output
    if os.path.isdir(output):
        args.usage_error(f"-o {output}: a folder; -o names the picture file to write, e.g. "
                         f"{os.path.join(output, f'pack{args.pack}.png')}")
    if os.path.splitext(output)[1].lower() not in Image.registered_extensions():
        args.usage_error(f"-o {output}: not a picture file name (its extension says the format); name the PNG file "
                         f"to write, e.g. {output.rstrip('.')}.png")


def _dropped(config: Any, pack: int, index: Any, tokens: int) -> str:
    """Why the pack has fewer tokens than ``mmidx index`` counted for it, if it does: the index packs the
    samples whole, and CFG dropout (drawn per pack, as in training) then removes the dropped elements."""
    from dataclasses import replace

    from mmidx.config import DropoutConfig
    from mmidx.pack.builder import PackBuilder

    whole = PackBuilder(replace(config, dropout=DropoutConfig(0.0, 0.0, 0.0))).build(pack, index.items(pack))
    if whole.sequence_length == tokens:
        return ""
    return (f" ({whole.sequence_length:,} as indexed: CFG dropout dropped {whole.sequence_length - tokens:,} "
            "tokens of text or image elements, as training does)")


def register(commands: Commands) -> None:
    sub = add_command(commands, "index", cmd_index,
                      "Build the pack index (or, with --gpt, Megatron GPT indices) and print its statistics.")
    add_pack_arguments(sub, history=True)
    sub.add_argument("--gpt", action="store_true", help="build GPT sample indices of text datasets instead")
    sub.add_argument("--seq-length", type=at_least(1), help="GPT sequence length (with --gpt)")
    sub.add_argument("--json", action="store_true", help="print the statistics (or the --mixture report) as JSON")
    sub.add_argument("--mixture", action="store_true",
                     help="report what the index delivers per phase and group: samples, tokens, share vs weight, "
                          "epochs and the pack at which each ended")
    sub.add_argument("--world-size", type=at_least(1),
                     help="with --global-batch-size: report fill, step balance and GPU efficiency of both packing "
                          "policies at this world size")
    sub.add_argument("--global-batch-size", type=at_least(1),
                     help="packs per optimizer step (a multiple of --world-size)")
    sub = add_command(commands, "show", cmd_show, "Render a pack's layout above its attention mask to a PNG.")
    add_pack_arguments(sub, history=True)
    sub.add_argument("--pack", type=at_least(0), default=0, help="pack number")
    sub.add_argument("-o", "--output", default="pack.png", help="PNG file to write")
    sub.add_argument("--width", type=at_least(1), default=1024, help="picture width in pixels")
    sub.add_argument("--zoom-sample", type=at_least(0),
                     help="position in the pack of the sample to zoom into (default: the one with the most splits)")
