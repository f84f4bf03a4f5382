"""Packed batches per second: mmidx vs BAGEL's own PackedDataset, on the same generated files.

Generates (once, under --workdir) a BAGEL-format corpus of 512² JPEGs (``--image-size``; :mod:`mmidx.toolkit.synthetic`:
t2i parquet, edit parquet, vlm JSONL + images), builds the mmidx datasets from it, and for t2i,
edit, vlm and a 1:1:1 mix measures on one thread:

* end-to-end tokens per CPU-second of ~32K-token packs (CPU time of the process, so that other
  load on a shared machine does not count; the wall-clock ratio is printed too): images decoded and
  transformed, batch tensors built, split metadata instead of masks (flex); and the same plus dense
  masks built on the CPU (dense);
* mask build time per pack on the CPU: dense per-sample masks (with an allocate-and-fill of the
  same tensors, the memory floor, in the same run) and the FlexAttention BlockMask;
* bytes per pack.

With ``--bagel-src DIR`` (a checkout of ByteDance-Seed/Bagel; its ``data`` package is imported
unmodified) BAGEL's ``PackedDataset`` reads the same raw files with the same tokenizer and
budgets, in flex and dense mode, and the table shows the ratios; then BAGEL's own image transforms
(real torchvision) are checked bit-identical to mmidx's on the corpus's images. ``--bagel-site DIR``: BAGEL's
extra packages for a CPU-only torch (see bagel_peer.py, which holds the corpus and the BAGEL-importing code this
script shares with tools/check_bagel.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from bagel_peer import BUDGETS, DROPOUT, MODES, import_bagel, packed_dataset, prepare
from PIL import Image

from mmidx.config import DataConfig
from mmidx.index.pack_index import build_pack_index
from mmidx.pack.builder import PackBuilder
from mmidx.pack.masks import block_mask, dense_masks
from mmidx.toolkit.bench import StageClock, machine
from mmidx.toolkit.demo import BAGEL_GROUPS


def batch_bytes(tensors: dict[str, Any]) -> int:
    total = 0
    for value in tensors.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            total += sum(t.numel() * t.element_size() for t in value)
    return total


def _config_and_items(datasets: Path, groups: list[str], packs: int,
                      geometry: dict[str, int] | None = None) -> tuple[DataConfig, list[Any]]:
    spec = yaml.safe_load((datasets / "data.yaml").read_text())
    config = DataConfig.from_dict({"groups": {g: spec["groups"][g] for g in groups}, "packing": BUDGETS,
                                   "dropout": DROPOUT, "geometry": geometry or {}}, base_dir=datasets)
    index = build_pack_index(config, num_samples=packs * 40)
    packs = min(packs, len(index) - 1)  # the last pack may be partial
    return config, [index.items(k) for k in range(packs)]


def _throughput(builder: PackBuilder, items: list[Any], mode: str) -> dict[str, float]:
    """Tokens per CPU-second and per wall-second, and MB per pack, of building ``items``' packs as batch dicts."""
    builder.build(0, items[0])  # warm caches
    tokens, nbytes, start, cpu = 0, 0, time.perf_counter(), time.process_time()
    for k in range(len(items)):
        batch = builder.build(k, items[k])
        data = batch.to_dict()
        tokens += batch.sequence_length
        nbytes += batch_bytes(data)
    return {f"{mode}_tokens_per_s": tokens / (time.process_time() - cpu),
            f"{mode}_wall_tokens_per_s": tokens / (time.perf_counter() - start),
            f"{mode}_mb_per_pack": nbytes / len(items) / 1e6}


def run_mmidx(datasets: Path, groups: list[str], packs: int) -> dict[str, float]:
    config, items = _config_and_items(datasets, groups, packs)
    packs = len(items)
    result: dict[str, float] = {}
    for mode, use_flex in (("flex", True), ("dense", False)):
        result.update(_throughput(PackBuilder(config, use_flex=use_flex), items, mode))
    builder = PackBuilder(config)
    dense_ms, floor_ms, block_ms = [], [], []
    for k in range(packs):
        batch = builder.build(k, items[k])
        split_lens, attn_modes, sample_lens = batch.flat_split_metadata(pad=False)
        start = time.perf_counter()
        masks = dense_masks(split_lens, attn_modes, sample_lens, device="cpu")
        dense_ms.append((time.perf_counter() - start) * 1e3)
        del masks
        start = time.perf_counter()
        filled = [torch.empty(n, n).fill_(0.0) for n in sample_lens]
        floor_ms.append((time.perf_counter() - start) * 1e3)
        del filled
        start = time.perf_counter()
        block_mask(*batch.flat_split_metadata(pad=True), device="cpu")
        block_ms.append((time.perf_counter() - start) * 1e3)
    result.update(dense_mask_ms=statistics.median(dense_ms), fill_floor_ms=statistics.median(floor_ms),
                  block_mask_ms=statistics.median(block_ms), packs=packs)
    return result


def run_bagel(raw: Path, groups: list[str], packs: int, bagel_src: str, bagel_site: str | None) -> dict[str, float]:
    """BAGEL's own PackedDataset over the same raw files: tokens per CPU-second and wall-second, MB per pack."""
    import_bagel(bagel_src, bagel_site)
    result: dict[str, float] = {}
    for mode, use_flex in (("flex", True), ("dense", False)):
        iterator = iter(packed_dataset(raw, groups, use_flex))
        next(iterator)  # warm up
        tokens, nbytes, start, cpu = 0, 0, time.perf_counter(), time.process_time()
        for _ in range(packs):
            data = next(iterator)
            tokens += data["sequence_length"]
            nbytes += batch_bytes(data)
        result[f"{mode}_tokens_per_s"] = tokens / (time.process_time() - cpu)
        result[f"{mode}_wall_tokens_per_s"] = tokens / (time.perf_counter() - start)
        result[f"{mode}_mb_per_pack"] = nbytes / packs / 1e6
    return result


def check_pixels(raw: Path, bagel_src: str, bagel_site: str | None) -> int:
    """BAGEL's ``pil_img2rgb`` + ``ImageTransform`` (real torchvision) against mmidx's decode + transform on the
    corpus's images, as stored and cut to other sizes, with every group's transforms and several
    img_num: each output is checked bit-identical; returns how many were compared."""
    import_bagel(bagel_src, bagel_site)
    from data.data_utils import pil_img2rgb  # BAGEL's own, unmodified
    from data.transforms import ImageTransform as BagelTransform

    from mmidx.images.decode import decode_rgb
    from mmidx.images.transform import ImageTransform

    datas = [path.read_bytes() for path in sorted((raw / "vlm" / "images").glob("*.jpg"))[:6]]
    for index, size in enumerate([(300, 700), (1500, 900), (64, 2000), (1100, 97)]):
        buffer = io.BytesIO()
        Image.open(io.BytesIO(datas[index])).resize(size).save(buffer, "JPEG", quality=90)
        datas.append(buffer.getvalue())
    arguments = [args for group in BAGEL_GROUPS.values()
                 for key, args in group.items() if key.endswith("transform_args")]
    compared = 0
    for args in arguments:
        ours, theirs = ImageTransform.from_args(args), BagelTransform(**args)
        for data in datas:
            for img_num in (1, 2, 5):
                expected = theirs(pil_img2rgb(Image.open(io.BytesIO(data))), img_num=img_num)
                if not torch.equal(ours(decode_rgb(data), img_num=img_num), expected):
                    raise AssertionError(f"pixels differ from BAGEL's for {args}, img_num={img_num}")
                compared += 1
    return compared


class BenchViT(torch.nn.Module):
    """A stand-in for a frozen ViT (BAGEL's SigLIP: 14-pixel patches, 1152 wide): its patch embedding, a conv
    with kernel = stride = 14, whose (B, 1152, H/14, W/14) output packs carry as ``packed_vit_embeddings``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = torch.nn.Conv2d(3, 1152, kernel_size=14, stride=14)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.embed(images)


class BenchVAE(torch.nn.Module):
    """A stand-in for a frozen VAE encoder (BAGEL's: 16 latent channels, 8× down): conv, GroupNorm, moments.
    Only the shape of its output matters to the packs; its cost is not what precache's figure is about."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.down = torch.nn.Conv2d(3, 32, kernel_size=8, stride=8)
        self.norm = torch.nn.GroupNorm(4, 32)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, logvar = self.norm(self.down(images)).chunk(2, dim=1)
        return mean, logvar


class BenchVAE2(BenchVAE):
    """A second frozen image encoder of the same transform, for the two-encoders-in-one-pass figure."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.down = torch.nn.Conv2d(3, 32, kernel_size=8, stride=8)


def _precache_rate(config: DataConfig, jobs: list[Any], encoders: list[torch.nn.Module]) -> float:
    """Images per CPU-second of one pass over the groups' VAE images with ``jobs`` (one thread)."""
    from mmidx.encodings.encode import RunOptions
    from mmidx.encodings.precache import precache_pass

    images, cpu = 0, time.process_time()
    for group in config.groups:
        for prefix in group.datasets:
            metas = precache_pass(prefix, jobs, {"vae": group.vae_transform, "vit": group.vit_transform},
                                  RunOptions(progress=False, encoders=encoders))
            images += metas[0]["counts"]["records"]
    return images / (time.process_time() - cpu)


def _worker_ms(builders: dict[str, PackBuilder], items: list[Any], rounds: int = 2) -> dict[str, float]:
    """Median CPU ms of ``PackDataset[k]`` (``builder.build``: what a loader worker spends on pack k) per builder,
    the builders interleaved pack by pack so that load from other jobs falls on all of them alike."""
    for builder in builders.values():
        builder.build(0, items[0])  # warm caches
    spent: dict[str, list[float]] = {name: [] for name in builders}
    for _ in range(rounds):
        for k in range(len(items)):
            for name, builder in builders.items():
                cpu = time.process_time()
                builder.build(k, items[k])
                spent[name].append((time.process_time() - cpu) * 1e3)
    return {name: statistics.median(values) for name, values in spent.items()}


def run_latents(datasets: Path, groups: list[str], packs: int, geometry: dict[str, int], vit: bool) \
        -> dict[str, float]:
    """Precache the groups' VAE images as moments with one encoder, then with two in one pass (images per
    CPU-second), and (``vit``) their ViT images; then the worker-side CPU ms of a pack with pixels against
    one with latents (and with ViT encodings), interleaved, and the ViT pixels' share of the latent pack."""
    from mmidx.encodings.encode import Job

    config, items = _config_and_items(datasets, groups, packs, geometry)
    vae = Job("bench_moments", "bench_pack:BenchVAE", batch_size=8)
    result = {"one_encoder_images_per_s": _precache_rate(config, [vae], [BenchVAE().eval()]),
              "two_encoders_images_per_s": _precache_rate(
                  config, [dataclasses.replace(vae, name="bench_moments_a"),
                           Job("bench_mean_b", "bench_pack:BenchVAE2", store="mean", batch_size=8)],
                  [BenchVAE().eval(), BenchVAE2().eval()])}
    builders = {"pixels": PackBuilder(config), "latents": PackBuilder(config, encodings={"vae": vae.name})}
    if vit:
        job = Job("bench_vit", "bench_pack:BenchViT", transform="vit", batch_size=8)
        from mmidx.encodings.precache import precache_dataset

        for group in config.groups:
            for prefix in group.datasets:
                precache_dataset(prefix, job, group.vit_transform, progress=False, encoder=BenchViT().eval())
        builders["frozen_vit"] = PackBuilder(config, encodings={"vae": vae.name, "vit": job.name})
    result.update({f"{name}_ms": ms for name, ms in _worker_ms(builders, items).items()})
    clock = StageClock()  # the latent pack's remaining pixel work: its ViT images (VAE images are not decoded)
    timed = PackBuilder(config, encodings={"vae": vae.name}, stage=clock)
    start = time.perf_counter()  # wall time, as the stage clock's
    for k in range(len(items)):
        timed.build(k, items[k])
    total = time.perf_counter() - start
    pixel_share = sum(clock.seconds[stage] for stage in ("decode", "resize", "normalise")) / total
    result["vit_pixel_share"] = pixel_share
    sampled = builders["latents"].build(0, items[0])
    cpu = time.process_time()
    sampled.to("cpu").to_dict()
    result["draw_ms"] = (time.process_time() - cpu) * 1e3  # the trainer's side, here on the CPU
    result["tokens"] = statistics.mean(builders["pixels"].build(k, items[k]).sequence_length for k in range(len(items)))
    return result


def print_encodings(args: argparse.Namespace, sizes: list[int]) -> None:
    """The --encodings table, per image size: worker-side ms per pack, pixels against latents, and precache
    images/s with one and two encoders in a pass."""
    print(f"{'JPEGs':<6} {'mode':<16} {'pixels ms':>10} {'latents ms':>11} {'×':>6} {'Amdahl bound':>13} "
          f"{'of bound':>9} {'draw ms':>8} {'precache img/s 1 enc':>21} {'2 enc, one pass':>16}")
    for size, mode in ((size, mode) for size in sizes for mode in ("t2i", "edit")):
        _, datasets = prepare(Path(args.workdir), size)
        # 1024² VAE images (BAGEL's t2i transform caps at 1024) need BAGEL's 1024 setting of max_latent_size
        r = run_latents(datasets, MODES[mode], args.packs, {"max_latent_size": 64} if size > 512 else {},
                        vit=mode == "edit")
        print(f"{size:<6} ", end="")
        rates = f"{r['one_encoder_images_per_s']:>21.1f} {r['two_encoders_images_per_s']:>16.1f}"
        if mode == "t2i":
            print(f"{'t2i':<16} {r['pixels_ms']:>10.1f} {r['latents_ms']:>11.1f} "
                  f"{r['pixels_ms'] / r['latents_ms']:>6.1f} {'-':>13} {'-':>9} {r['draw_ms']:>8.1f} {rates}")
            continue
        bound = r["pixels_ms"] / (r["vit_pixel_share"] * r["latents_ms"])
        speedup = r["pixels_ms"] / r["latents_ms"]
        print(f"{'edit, ViT train':<16} {r['pixels_ms']:>10.1f} {r['latents_ms']:>11.1f} {speedup:>6.1f} "
              f"{bound:>13.1f} {speedup / bound:>9.2f} {r['draw_ms']:>8.1f} {rates}")
        print(f"{size:<6} {'edit, ViT frozen':<16} {r['pixels_ms']:>10.1f} {r['frozen_vit_ms']:>11.1f} "
              f"{r['pixels_ms'] / r['frozen_vit_ms']:>6.1f} {'-':>13} {'-':>9} {r['draw_ms']:>8.1f} {rates}")
    print("# ms: median CPU ms of PackDataset[k] (builder.build, what a loader worker spends) per ~32K-token pack,")
    print("# pixels and latents interleaved pack by pack; latents: bf16 moments of a 32-channel conv+GroupNorm")
    print("# stand-in VAE (8x down), shipped with their (seed, pack) key: the sample is drawn on the batch's")
    print("# device ('draw ms': to('cpu').to_dict() of one pack here, on the trainer's side, not the worker's).")
    print("# ViT frozen: the ViT images as bf16 outputs of a 1152-wide 14-pixel patch embedding as well.")
    print("# Amdahl bound: pixels ms / the ViT pixel work left in the latent pack (decode+resize+normalise).")
    print("# precache img/s: decode + BAGEL transform + encoder(s) + store per CPU-second, one thread, batches of 8;")
    print("# '2 enc': a second conv encoder fed the same transformed pixels in the same pass.")


def _commit() -> str:
    """The checkout's short commit (with "+changes" when its tracked files differ from it), or "unknown"."""
    import subprocess

    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=Path(__file__).parent, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip()
    return (commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no").strip() else "")) \
        if commit else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-pack", help="generated corpus and datasets")
    parser.add_argument("--packs", type=int, default=10, help="packs timed per mode")
    parser.add_argument("--modes", default="t2i,edit,vlm,mix")
    parser.add_argument("--bagel-src", help="checkout of ByteDance-Seed/Bagel to compare with")
    parser.add_argument("--bagel-site", help="folder with torchvision, decord, cv2 for BAGEL (see the docstring)")
    parser.add_argument("--encodings", action="store_true",
                        help="only: precache the VAE (and edit's ViT) images of t2i and edit with one and two "
                             "encoders a pass, and time the worker side of packs with their encodings vs pixels "
                             "(--image-size 512,1536: both sizes in one run)")
    parser.add_argument("--image-size", default="512",
                        help="side of the generated JPEGs (BAGEL's t2i VAE transform resizes those over 1024)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [int(size) for size in args.image_size.split(",")]
    if args.encodings:
        print(f"# bench_pack --encodings — one thread, packs of ~32K tokens (BAGEL budgets), {args.packs} packs per "
              f"mode, {' and '.join(f'{size}²' for size in sizes)} JPEGs")
        print(f"# {machine('torch', 'Pillow')}, commit {_commit()}")
        print(f"# load average before: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores; this machine is "
              "shared with other jobs")
        print_encodings(args, sizes)
        print(f"# load average after: {os.getloadavg()[0]:.2f} (1 min)")
        return
    args.image_size = sizes[0]
    raw, datasets = prepare(Path(args.workdir), args.image_size)
    print(f"# bench_pack — one thread, packs of ~32K tokens (BAGEL budgets), {args.packs} packs per mode, "
          f"{args.image_size}² JPEGs")
    print(f"# {machine('torch', 'Pillow')}")
    header = (f"{'mode':<5} {'mmidx flex tok/s':>16} {'mmidx dense tok/s':>17} {'MB/pack':>8} {'dense ms':>9} "
              f"{'fill ms':>8} {'ratio':>6} {'BlockMask ms':>12}")
    if args.bagel_src:
        header += f" {'BAGEL flex':>11} {'BAGEL dense':>11} {'flex ×':>7} {'dense ×':>8} {'flex × wall':>11}"
    print(header)
    for mode in args.modes.split(","):
        ours = run_mmidx(datasets, MODES[mode], args.packs)
        line = (f"{mode:<5} {ours['flex_tokens_per_s']:>16,.0f} {ours['dense_tokens_per_s']:>17,.0f} "
                f"{ours['flex_mb_per_pack']:>8.0f} {ours['dense_mask_ms']:>9.0f} {ours['fill_floor_ms']:>8.0f} "
                f"{ours['dense_mask_ms'] / ours['fill_floor_ms']:>6.2f} {ours['block_mask_ms']:>12.1f}")
        if args.bagel_src:
            theirs = run_bagel(raw, MODES[mode], args.packs, args.bagel_src, args.bagel_site)
            line += (f" {theirs['flex_tokens_per_s']:>11,.0f} {theirs['dense_tokens_per_s']:>11,.0f}"
                     f" {ours['flex_tokens_per_s'] / theirs['flex_tokens_per_s']:>7.2f}"
                     f" {ours['dense_tokens_per_s'] / theirs['dense_tokens_per_s']:>8.2f}"
                     f" {ours['flex_wall_tokens_per_s'] / theirs['flex_wall_tokens_per_s']:>11.2f}")
        print(line, flush=True)
    if args.bagel_src:
        compared = check_pixels(raw, args.bagel_src, args.bagel_site)
        print(f"# pixels: {compared} image transforms (every group's, img_num 1/2/5, 512² and cut sizes) "
              "bit-identical to BAGEL's pil_img2rgb + ImageTransform")
    print("# tok/s: real tokens (not padding) per second of this process's CPU time, so that other load on a shared")
    print("# machine does not count; 'flex × wall' is the flex ratio by wall-clock time instead.")
    print("# dense ms: mmidx dense masks of one pack; fill ms: allocating and filling tensors of the same shapes")
    print("# (the memory floor); ratio = dense / fill. Medians over the packs.")


if __name__ == "__main__":
    main()
