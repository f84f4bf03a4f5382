"""The ``mmidx`` command line: build, index, inspect, verify, show, demo.

Each subcommand is a small function taking the parsed arguments and returning an exit code;
``main`` only wires them to argparse.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mmidx.format import FormatError


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
    files = ", ".join(f"{name} {_human_bytes(size)}" for name, size in info["files"].items())
    lines.append(f"  files            {files}")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    from mmidx.checks import summary
    from mmidx.dataset import MMIDXDataset

    try:
        info = summary(MMIDXDataset(args.prefix))
    except FormatError as error:
        print(f"mmidx: {error}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=1) if args.json else format_summary(info))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from mmidx import format as fmt
    from mmidx.checks import verify

    try:
        problems = verify(args.prefix, decode=args.decode)
    except Exception as error:  # whatever the files hold: one line, never a traceback
        print(f"mmidx: {args.prefix}: verification stopped: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if problems:
        print(f"{args.prefix}: {len(problems)} problem(s) found", file=sys.stderr)
        return 1
    images = "every image decoded" if args.decode else "image headers probed"
    if not fmt.file_path(args.prefix, "meta").exists():
        print(f"{args.prefix}: OK (structure only: a Megatron pair without mmidx metadata, so no checksum "
              "guards its bytes)")
    else:
        print(f"{args.prefix}: OK (checksums and structure verified, {images})")
    return 0


Commands = Any  # the object argparse's add_subparsers returns


def add_command(commands: Commands, name: str, handler: Callable[[argparse.Namespace], int],
                help: str) -> argparse.ArgumentParser:
    """Register subcommand ``name``; modules that own a command call this from their ``register``."""
    sub = commands.add_parser(name, help=help, description=help)
    sub.set_defaults(handler=handler)
    return sub


def _register_inspect_and_verify(commands: Commands) -> None:
    sub = add_command(commands, "inspect", cmd_inspect,
                      "Print counts, size statistics, element kinds, images and file sizes.")
    sub.add_argument("prefix", help="dataset prefix (path without .idx/.bin)")
    sub.add_argument("--json", action="store_true", help="print machine-readable JSON")
    sub = add_command(commands, "verify", cmd_verify,
                      "Recompute checksums and structural invariants, probe every image; exit 1 on any problem.")
    sub.add_argument("prefix", help="dataset prefix (path without .idx/.bin)")
    sub.add_argument("--decode", action="store_true", help="also decode every stored image (slower)")


def _data_config(args: argparse.Namespace) -> Any:
    from mmidx.config import ModelGeometry, config_for

    overrides = {"seed": args.seed} if args.seed is not None else {}
    if args.max_latent_size is not None:
        overrides["geometry"] = ModelGeometry(max_latent_size=args.max_latent_size)
    return config_for(args.config, **overrides)


def cmd_index(args: argparse.Namespace) -> int:
    if args.gpt:
        from mmidx.gpt import GPTTextDataset

        if args.seq_length is None:
            print("mmidx index --gpt needs --seq-length", file=sys.stderr)
            return 2
        for prefix in args.config:
            samples = GPTTextDataset(prefix, seq_length=args.seq_length, num_samples=args.num_samples,
                                     seed=1234 if args.seed is None else args.seed, cache_dir=args.cache_dir)
            print(f"{prefix}: {len(samples):,} GPT samples of {args.seq_length} tokens cached in {args.cache_dir}")
        return 0
    from mmidx.pack_index import build_pack_index

    index = build_pack_index(_data_config(args), num_samples=args.num_samples, cache_dir=args.cache_dir)
    if args.json:
        print(json.dumps(index.stats, indent=1))
        return 0
    stats = index.stats
    print(f"pack index {index.path or '(not cached)'}")
    print(f"  samples {stats['samples']:,} ({', '.join(f'{k} {v:,}' for k, v in stats['groups'].items())})")
    print(f"  packs {stats['num_packs']:,}   tokens {stats['tokens']:,}   fill {stats['fill_vs_max']:.3f} of "
          f"max_num_tokens, {stats['fill_vs_expected']:.3f} of expected")
    print(f"  excluded (over max_num_tokens_per_sample) {stats['excluded']:,}   deferred {stats['deferred']:,}   "
          f"max deferral {stats['max_deferral']} packs   solo packs {stats['solo_packs']}")
    print(f"  built in {stats['build_seconds']} s")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from mmidx.pack_index import build_pack_index
    from mmidx.packing import PackBuilder
    from mmidx.show import render

    config = _data_config(args)
    index = build_pack_index(config, num_samples=args.num_samples, cache_dir=args.cache_dir)
    if not 0 <= args.pack < len(index):
        print(f"mmidx: pack {args.pack} out of range: the index has {len(index)} packs", file=sys.stderr)
        return 1
    batch = PackBuilder(config).build(args.pack, index.items(args.pack))
    render(batch, width=args.width).save(args.output)
    print(f"{args.output}: pack {args.pack}, {batch.sequence_length:,} tokens in {len(batch.sample_lens)} samples")
    return 0


def _register_index_and_show(commands: Commands) -> None:
    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("config", nargs="+", help="a data.yaml, or dataset prefixes (one group each)")
        sub.add_argument("--num-samples", type=int, help="samples in the stream (default: one epoch of all)")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmidx", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    from mmidx import build, demo  # they register through add_command, so they import this module

    # Each module that owns a command registers it here (one line each).
    _register_inspect_and_verify(commands)
    _register_index_and_show(commands)
    build.register(commands)
    demo.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (FormatError, ValueError) as error:  # bad files or bad configuration: say what, not where
        print(f"mmidx: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
