"""``mmidx precache``: run a frozen encoder once over a dataset and store its outputs beside it.
"""

from __future__ import annotations

import argparse

from mmidx.cli.common import Commands, add_command


def cmd_precache(args: argparse.Namespace) -> int:
    from mmidx.encodings.encode import Job
    from mmidx.encodings.precache import precache

    job = Job(args.name, args.encoder, modality=args.modality, transform=args.transform, store=args.store,
              dtype=args.dtype, batch_size=args.batch_size, weights_version=args.weights_version)
    metas = precache(args.path, job, device=args.device, workers=args.workers, progress=not args.quiet,
                     engine=args.engine, ray_address=args.ray_address)
    for meta in metas:
        print(f"{meta['name']}: {meta['counts']['records']} {meta['modality']} encodings ({meta['store']}, "
              f"{meta['dtype']}) of dataset {meta['dataset']['checksum'][:12]}")
    return 0


def register(commands: Commands) -> None:
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
