"""Packed batches per second: mmidx vs BAGEL's own PackedDataset, on the same generated files.

Generates (once, under --workdir) a BAGEL-format corpus of 512² JPEGs (``--image-size``; :mod:`mmidx.toolkit.synthetic`:
t2i parquet, edit parquet, vlm JSONL + images), builds the mmidx datasets from it, and for t2i,
edit, vlm and a 1:1:1 mix measures on one thread:

* end-to-end tokens per CPU-second of ~32K-token packs (CPU time of the process; the wall-clock
  ratio is printed too): images decoded and transformed, batch tensors built, split metadata
  instead of masks (flex); and the same plus dense masks built on the CPU (dense);
* the decode floor: the stored images each pack decodes (the JPEGs ``decode_images="device"`` would
  ship), decoded alone through mmidx's decoder with no transform, and each mode's pack time as a
  multiple of it (a t2i pack of 512² images needs no resize: decode + normalise); and the decode + store
  floor: the same decoding, then storing as many float32 values as the pack's pixel keys hold
  (``padded_images``, ``packed_vit_tokens``: what any exact transform writes) into a batch buffer of the
  pool the packs use (numpy's fill, a memset), a floor no float32 output can go under;
* mask build time per pack on the CPU: dense per-sample masks (with an allocate-and-fill of the
  same tensors by torch's allocator in the same run) and the FlexAttention BlockMask;
* bytes per pack.

With ``--bagel-src DIR`` (a checkout of ByteDance-Seed/Bagel; its ``data`` package is imported
unmodified) BAGEL's ``PackedDataset`` reads the same raw files with the same tokenizer and
budgets, in flex and dense mode, and the table shows the ratios. The protocol is ``common.py``'s:
mmidx flex and dense, BAGEL flex and dense (each pulling the next pack of its PackedDataset
stream) and the two floors take turns pack by pack over ``--rounds`` rounds, the first rotating;
each round gives one tokens/CPU-s ratio, the table shows the median and range, each mode's load
and other processes' cores are printed, and its headline is withheld when those exceeded half a
core. The defaults (``--packs 8 --rounds 5``) took 4.6 to 8 minutes for the four modes on 2 cores
while other jobs kept 1.3 to 1.6 of them busy, less on a quiet machine. Then BAGEL's own image transforms
(real torchvision) are checked bit-identical to mmidx's on the corpus's images. ``--bagel-site DIR``: BAGEL's
extra packages for a CPU-only torch (see bagel_peer.py, which holds the corpus and the BAGEL-importing code this
script shares with tools/check_bagel.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from bagel_peer import BUDGETS, DROPOUT, MODES, import_bagel, packed_dataset, prepare
from common import Watch, interleave, machine, ratio
from PIL import Image

from mmidx.config import DataConfig
from mmidx.images.decode import decode_rgb_pixels
from mmidx.index.pack_index import build_pack_index
from mmidx.pack.buffers import _batch_buffer
from mmidx.pack.builder import PackBuilder
from mmidx.pack.masks import block_mask, dense_masks
from mmidx.toolkit.bench import StageClock
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


def _pack_images(config: DataConfig, items: list[Any]) -> list[list[bytes]]:
    """The encoded bytes of the stored images each pack decodes (each once, CFG-dropped images left out): what
    ``decode_images="device"`` ships instead of pixels, the same images the loader-side build decodes."""
    deferred = PackBuilder(config, decode_images="device")
    packs = []
    for k in range(len(items)):
        images = deferred.build(k, items[k]).deferred
        packs.append([] if images is None else [data.numpy().tobytes() for data in images.encoded])
    return packs


def _decode_floor(images: list[bytes]) -> int:
    """Decode a pack's images through mmidx's decoder (simplejpeg for YCbCr and grey JPEGs), nothing else."""
    for data in images:
        decode_rgb_pixels(data)
    return len(images)


PIXEL_KEYS = ("padded_images", "packed_vit_tokens")


def _pixel_values(builder: PackBuilder, items: list[Any]) -> list[int]:
    """How many float32 values each pack's pixel keys hold (``PIXEL_KEYS``)."""
    counts = []
    for k in range(len(items)):
        batch = builder.build(k, items[k]).to_dict()
        counts.append(sum(batch[key].numel() for key in PIXEL_KEYS if key in batch))
    return counts


def _decode_store_floor(images: list[bytes], values: int) -> int:
    """The decode floor, then ``values`` float32 zeros stored into a batch buffer of the packs' pool."""
    _decode_floor(images)
    if values:
        _batch_buffer(values).numpy().fill(0.0)
    return len(images)


def _mmidx_side(builder: PackBuilder, items: list[Any], log: list[tuple[int, int]]) -> Callable[[int], None]:
    def build(k: int) -> None:  # the batch dict a trainer receives; nothing kept, so batch buffers are reused
        batch = builder.build(k, items[k])
        log.append((batch.sequence_length, batch_bytes(batch.to_dict())))
    return build


def _bagel_side(packs: Iterator[dict[str, Any]], log: list[tuple[int, int]]) -> Callable[[int], None]:
    def pull(_k: int) -> None:  # BAGEL's PackedDataset is a stream: its next pack, whichever it is
        data = next(packs)
        log.append((data["sequence_length"], batch_bytes(data)))
    return pull


def _rates(log: list[tuple[int, int]], seconds: list[float]) -> list[float]:
    """Tokens per second of each round, from a side's (tokens, bytes) log of every pack in order."""
    per_round = len(log) // len(seconds)
    return [sum(tokens for tokens, _ in log[r * per_round:(r + 1) * per_round]) / spent
            for r, spent in enumerate(seconds)]


def compare(raw: Path, datasets: Path, groups: list[str], packs: int, rounds: int, bagel_src: str | None,
            bagel_site: str | None) -> dict[str, Any]:
    """Every side on every pack, taking turns pack by pack over ``rounds`` rounds (``common.interleave``):
    mmidx flex and dense, BAGEL flex and dense (with ``bagel_src``), the decode floor (the same packs'
    images decoded alone) and the decode + store floor. Returns per-round rates and ratios, MB per pack and the
    masks' median times."""
    config, items = _config_and_items(datasets, groups, packs)
    indexes = list(range(len(items)))
    logs: dict[str, list[tuple[int, int]]] = {}
    sides: dict[str, Callable[[int], Any]] = {}
    for mode, use_flex in (("flex", True), ("dense", False)):
        builder = PackBuilder(config, use_flex=use_flex)
        builder.build(0, items[0]).to_dict()  # warm caches and the batch buffers
        sides[f"mmidx {mode}"] = _mmidx_side(builder, items, logs.setdefault(f"mmidx {mode}", []))
        if bagel_src:
            stream = bagel_packs(raw, groups, use_flex, bagel_src, bagel_site)
            next(stream)  # warm up
            sides[f"BAGEL {mode}"] = _bagel_side(stream, logs.setdefault(f"BAGEL {mode}", []))
    images = _pack_images(config, items)
    values = _pixel_values(PackBuilder(config), items)
    _decode_floor(images[0])
    sides["decode"] = lambda k: _decode_floor(images[k])
    sides["decode + store"] = lambda k: _decode_store_floor(images[k], values[k])
    turns = interleave(sides, indexes, rounds)
    result: dict[str, Any] = {"packs": len(items), "images": sum(map(len, images)) / len(items)}
    for side, log in logs.items():
        for clock in ("cpu", "wall"):
            result[f"{side} {clock}"] = _rates(log, turns.per_round(side, clock))
        result[f"{side} MB"] = statistics.mean(nbytes for _, nbytes in log) / 1e6
    floor = turns.per_round("decode")
    for mode in ("flex", "dense"):
        result[f"{mode} / floor"] = ratio(turns.per_round(f"mmidx {mode}"), floor)
        if bagel_src:
            for clock in ("cpu", "wall"):
                result[f"{mode} × {clock}"] = ratio(result[f"mmidx {mode} {clock}"], result[f"BAGEL {mode} {clock}"])
    result["floor ms"] = statistics.median(floor) / len(items) * 1e3
    result["flex / store floor"] = ratio(turns.per_round("mmidx flex"), turns.per_round("decode + store"))
    result["store floor ms"] = statistics.median(turns.per_round("decode + store")) / len(items) * 1e3
    result.update(_mask_ms(PackBuilder(config), items))
    return result


def _cpu_ms(build: Callable[[], Any]) -> float:
    """CPU ms of this process making ``build``'s result and freeing it."""
    start = time.process_time()
    build()
    return (time.process_time() - start) * 1e3


def _filled(sample_lens: list[int]) -> list[torch.Tensor]:
    """Tensors of a pack's dense mask shapes, allocated by torch and filled."""
    return [torch.empty(n, n).fill_(0.0) for n in sample_lens]


def _mask_ms(builder: PackBuilder, items: list[Any]) -> dict[str, float]:
    """Median CPU ms per pack of its dense masks, of allocating (torch's allocator) and filling tensors of their
    shapes, and of its BlockMask, each freed again, on the CPU."""
    dense_ms, floor_ms, block_ms = [], [], []
    for k in range(len(items)):
        batch = builder.build(k, items[k])
        split_lens, attn_modes, sample_lens = batch.flat_split_metadata(pad=False)
        dense_ms.append(_cpu_ms(functools.partial(dense_masks, split_lens, attn_modes, sample_lens, device="cpu")))
        floor_ms.append(_cpu_ms(functools.partial(_filled, sample_lens)))
        block_ms.append(_cpu_ms(functools.partial(block_mask, *batch.flat_split_metadata(pad=True), device="cpu")))
    return {"dense mask ms": statistics.median(dense_ms), "fill ms": statistics.median(floor_ms),
            "BlockMask ms": statistics.median(block_ms)}


def bagel_packs(raw: Path, groups: list[str], use_flex: bool, bagel_src: str,
                bagel_site: str | None) -> Iterator[dict[str, Any]]:
    """BAGEL's own ``PackedDataset`` over the raw corpus (same tokenizer, budgets, dropout): its stream of packs."""
    import_bagel(bagel_src, bagel_site)
    return iter(packed_dataset(raw, groups, use_flex))


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


def _worker_ms(builders: dict[str, PackBuilder], items: list[Any], rounds: int) -> dict[str, Any]:
    """CPU ms of ``PackDataset[k]`` (``builder.build``: what a loader worker spends on pack k) per builder, the
    builders taking turns pack by pack over ``rounds`` rounds (common.interleave): each builder's median ms a
    pack, and each encodings builder's speed-up over pixels as the median of the per-round ratios."""
    for builder in builders.values():
        builder.build(0, items[0])  # warm caches
    def side(builder: PackBuilder) -> Callable[[int], None]:
        def build(k: int) -> None:
            builder.build(k, items[k])  # dropped at once, as a worker hands it over: its buffers are reused

        return build

    turns = interleave({name: side(builder) for name, builder in builders.items()}, range(len(items)), rounds)
    result: dict[str, Any] = {f"{name}_ms": statistics.median(ms * 1e3 for per_round in turns.cpu[name]
                                                               for ms in per_round) for name in builders}
    pixels = turns.per_round("pixels")
    result.update({f"{name}_speedup": ratio(pixels, turns.per_round(name)) for name in builders if name != "pixels"})
    return result


def run_latents(datasets: Path, groups: list[str], packs: int, geometry: dict[str, int], vit: bool,
                rounds: int) -> dict[str, Any]:
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
    result.update(_worker_ms(builders, items, rounds))
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
    """The --encodings table, per image size: worker-side ms per pack, pixels against latents (median of the
    per-round ratios and their range), and precache images/s with one and two encoders in a pass."""
    results = {}
    with Watch() as watch:
        for size, mode in ((size, mode) for size in sizes for mode in ("t2i", "edit")):
            _, datasets = prepare(Path(args.workdir), size)
            # 1024² VAE images (BAGEL's t2i transform caps at 1024) need BAGEL's 1024 setting of max_latent_size
            results[size, mode] = run_latents(datasets, MODES[mode], args.packs,
                                              {"max_latent_size": 64} if size > 512 else {},
                                              vit=mode == "edit", rounds=args.rounds)
    print(f"{'JPEGs':<6} {'mode':<16} {'pixels ms':>10} {'latents ms':>11} {'× pixels, median (range)':>32} "
          f"{'Amdahl bound':>13} {'of bound':>9} {'draw ms':>8} {'precache img/s 1 enc':>21} {'2 enc, one pass':>16}")
    for (size, mode), r in results.items():
        rates = f"{r['one_encoder_images_per_s']:>21.1f} {r['two_encoders_images_per_s']:>16.1f}"
        speedup = watch.headline(str(r["latents_speedup"]))
        if mode == "t2i":
            print(f"{size:<6} {'t2i':<16} {r['pixels_ms']:>10.1f} {r['latents_ms']:>11.1f} {speedup:>32} "
                  f"{'-':>13} {'-':>9} {r['draw_ms']:>8.1f} {rates}")
            continue
        bound = r["pixels_ms"] / (r["vit_pixel_share"] * r["latents_ms"])
        of_bound = watch.headline(f"{r['latents_speedup'].median / bound:.2f}")
        print(f"{size:<6} {'edit, ViT train':<16} {r['pixels_ms']:>10.1f} {r['latents_ms']:>11.1f} {speedup:>32} "
              f"{bound:>13.1f} {of_bound:>9} {r['draw_ms']:>8.1f} {rates}")
        print(f"{size:<6} {'edit, ViT frozen':<16} {r['pixels_ms']:>10.1f} {r['frozen_vit_ms']:>11.1f} "
              f"{watch.headline(str(r['frozen_vit_speedup'])):>32} {'-':>13} {'-':>9} {r['draw_ms']:>8.1f} {rates}")
    print("# ms: median CPU ms of PackDataset[k] (builder.build, what a loader worker spends) per ~32K-token pack,")
    print("# the builders taking turns pack by pack over the rounds; latents: bf16 moments of a 32-channel")
    print("# conv+GroupNorm stand-in VAE (8x down), shipped with their (seed, pack) key: the sample is drawn on")
    print("# the batch's device ('draw ms': to('cpu').to_dict() of one pack here: the trainer's side).")
    print("# ViT frozen: the ViT images as bf16 outputs of a 1152-wide 14-pixel patch embedding as well.")
    print("# Amdahl bound: pixels ms / the ViT pixel work left in the latent pack (decode+resize+normalise).")
    print("# precache img/s: decode + BAGEL transform + encoder(s) + store per CPU-second, one thread, batches of 8;")
    print("# '2 enc': a second conv encoder fed the same transformed pixels in the same pass.")
    print(f"# {watch.describe()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-pack", help="generated corpus and datasets")
    parser.add_argument("--packs", type=int, default=8, help="packs timed per mode (and per round)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the default table: every side builds the same packs each round")
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
        print(f"# {machine('torch', 'Pillow')}")
        print_encodings(args, sizes)
        return
    args.image_size = sizes[0]
    raw, datasets = prepare(Path(args.workdir), args.image_size)
    print(f"# bench_pack — one thread, packs of ~32K tokens (BAGEL budgets), {args.packs} packs per mode x "
          f"{args.rounds} rounds, sides taking turns pack by pack, {args.image_size}² JPEGs")
    print(f"# {machine('torch', 'Pillow', 'simplejpeg')}")
    print_packs(args, raw, datasets)


def print_packs(args: argparse.Namespace, raw: Path, datasets: Path) -> None:
    """The default table: mmidx against BAGEL (with --bagel-src) and against the decode floor, per mode, then
    each mode's load and verdict, and the headlines a quiet run may print."""
    bagel = bool(args.bagel_src)
    header = f"{'mode':<5} {'mmidx flex tok/s':>16} {'mmidx dense tok/s':>17}"
    if bagel:
        header += (f" {'BAGEL flex':>11} {'BAGEL dense':>11} {'flex × BAGEL':>26} {'dense × BAGEL':>26} "
                   f"{'flex × wall':>11}")
    header += (f" {'images':>6} {'decode ms':>9} {'flex ÷ floor':>12} {'dense ÷ floor':>13} "
               f"{'+ store ms':>10} {'flex ÷ it':>9} {'MB/pack':>8} {'dense ms':>9} {'fill ms':>8} "
               f"{'BlockMask ms':>12}")
    print(header)
    watches, results = {}, {}
    for mode in args.modes.split(","):
        with Watch() as watches[mode]:
            r = results[mode] = compare(raw, datasets, MODES[mode], args.packs, args.rounds, args.bagel_src,
                                        args.bagel_site)
        line = (f"{mode:<5} {statistics.median(r['mmidx flex cpu']):>16,.0f} "
                f"{statistics.median(r['mmidx dense cpu']):>17,.0f}")
        if bagel:
            line += (f" {statistics.median(r['BAGEL flex cpu']):>11,.0f} "
                     f"{statistics.median(r['BAGEL dense cpu']):>11,.0f}"
                     f" {r['flex × cpu']!s:>26} {r['dense × cpu']!s:>26} {r['flex × wall'].median:>10.2f}×")
        line += (f" {r['images']:>6.1f} {r['floor ms']:>9.1f} {r['flex / floor'].median:>11.2f}× "
                 f"{r['dense / floor'].median:>12.2f}× {r['store floor ms']:>10.1f} "
                 f"{r['flex / store floor'].median:>8.2f}× "
                 f"{r['mmidx flex MB']:>8.0f} {r['dense mask ms']:>9.0f} "
                 f"{r['fill ms']:>8.0f} {r['BlockMask ms']:>12.1f}")
        print(line, flush=True)
    if bagel:
        compared = check_pixels(raw, args.bagel_src, args.bagel_site)
        print(f"# pixels: {compared} image transforms (every group's, img_num 1/2/5, 512² and cut sizes) "
              "bit-identical to BAGEL's pil_img2rgb + ImageTransform")
    print("# tok/s: real tokens (not padding) per second of this process's CPU time, median over rounds; × BAGEL:")
    print("# median of the per-round ratios (lowest–highest); 'flex × wall' is the flex ratio by wall-clock time.")
    print("# images, decode ms: stored images a pack decodes, and decoding them alone (mmidx's decoder, no")
    print("# transform) per pack; ÷ floor: a pack's CPU time as a multiple of that, median over rounds. + store ms:")
    print("# decoding, then storing float32 zeros over as many values as the pack's pixel keys hold (a memset into")
    print("# the packs' buffer pool), per pack; flex ÷ it: the flex pack's CPU time as a multiple of that floor.")
    print("# dense ms: mmidx dense masks of one pack; fill ms: allocating (torch's allocator) and filling tensors of")
    print("# the same shapes; BlockMask ms: FlexAttention's block mask. CPU ms, each freed again, medians over the")
    print("# packs (bench_masks.py has the floor: the masks' bytes stored into reused memory).")
    for mode, watch in watches.items():
        print(f"# {mode}: {watch.describe()}")
    for mode, r in results.items():
        text = (f"{mode}: {r['flex / floor'].median:.2f}× the decode floor, "
                f"{r['flex / store floor'].median:.2f}× the decode + store floor (flex)")
        if bagel:
            text += f", flex {r['flex × cpu']}, dense {r['dense × cpu']} BAGEL's tokens per CPU-second"
        print(f"# headline {watches[mode].headline(text)}")

if __name__ == "__main__":
    main()
