"""``mmidx precache``: run frozen encoders once over a dataset and store their outputs beside it.
"""

from __future__ import annotations

import argparse

from mmidx.cli.common import PREFIX_OR_DATA_YAML, Commands, add_cache_arguments, add_command, at_least, default_note

SHORTHAND = ("encoder", "name")  # the single-encoder options: a one-entry config


def cmd_precache(args: argparse.Namespace) -> int:
    from mmidx.encodings.encode import Job
    from mmidx.encodings.precache import precache
    from mmidx.encodings.spec import read_precache_config

    if args.config is not None:
        given = [f"--{name}" for name in SHORTHAND if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--config names the encoders; {' and '.join(given)} are the one-encoder shorthand: "
                             "give one or the other")
        jobs = read_precache_config(args.config, args.batch_size)
    else:
        if args.encoder is None or args.name is None:
            raise ValueError("give --config precache.yaml, or --encoder and --name for one encoder")
        jobs = [Job(args.name, args.encoder, modality=args.modality, transform=args.transform, store=args.store,
                    dtype=args.dtype, batch_size=args.batch_size or 16, weights_version=args.weights_version,
                    input=args.input)]
    metas = precache(args.path, jobs, device=args.device, workers=args.workers, progress=not args.quiet,
                     engine=args.engine, ray_address=args.ray_address, force=args.force)
    for meta in metas:
        print(f"{meta['name']}: {meta['counts']['records']} {meta['modality']} encodings ({meta['store']}, "
              f"{meta['dtype']}) of dataset {meta['dataset']['checksum'][:12]}{_shards(meta)}")
    return 0


def _shards(meta: dict) -> str:
    """How a sharded dataset's encoding is stored: a stream beside each of its shards."""
    return f" (a stream beside each of its {meta['shards']:,} shards)" if "shards" in meta else ""


def register(commands: Commands) -> None:
    sub = add_command(commands, "precache", cmd_precache,
                      "Run frozen encoders once over every image (or text) of the datasets, several in one pass, "
                      "and store their outputs beside them (P.enc.KEY.*, also in object storage); packs then carry "
                      "padded_latent instead of padded_images.")
    sub.add_argument("path", metavar=PREFIX_OR_DATA_YAML, help="a dataset prefix or a data YAML (paths or URIs)")
    sub.add_argument("--config", help="precache.yaml: a list 'encodings:' (modality, key, precision, "
                                      "store_pad_tokens, input, encoder_config: {cls, kwargs})")
    sub.add_argument("--encoder", help="one encoder: pkg.module:factory or pkg.module.Class, called with no argument")
    sub.add_argument("--name", help="its encoding's name (letters, digits, _ and -)")
    sub.add_argument("--modality", choices=("image", "text"), default="image", help="what the encoder reads")
    sub.add_argument("--input", choices=("tokens", "text"), default="tokens",
                     help="a text encoder reads the dataset's token ids, or the texts' strings")
    sub.add_argument("--transform", choices=("vae", "vit"), default="vae",
                     help="which of the group's transforms (and element kind) feeds the encoder")
    sub.add_argument("--store", choices=("moments", "mean", "sample"), default="moments",
                     help="what to keep of a (mean, logvar) output; a single tensor is stored as is")
    sub.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="stored dtype")
    sub.add_argument("--device", default="cpu", help="where the encoders run (cpu, cuda, cuda:1)")
    sub.add_argument("--batch-size", type=at_least(1),
                     help=default_note("images (texts) per encoder call, of one shape", "16"))
    sub.add_argument("--workers", type=at_least(1), default=1,
                     help="local: threads decoding and transforming images; ray: encoder actors (one GPU each "
                          "with --device cuda)")
    sub.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="where the encoders run: this process, or actors of a Ray cluster (pip install "
                          "\"mmidx[ray]\"; the dataset must be readable there); the streams are the same")
    sub.add_argument("--ray-address", help=default_note("Ray cluster to join", "RAY_ADDRESS, else a new local one"))
    sub.add_argument("--weights-version", help="a version or hash of the encoder's weights, recorded")
    sub.add_argument("--quiet", action="store_true", help="no progress line")
    sub.add_argument("--force", action="store_true",
                     help="replace a finished encoding of the same name that another encoder or other options "
                          "computed (the same options compute it again without it)")
    add_cache_arguments(sub)
