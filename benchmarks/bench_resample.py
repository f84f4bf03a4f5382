"""The Pillow-exact resize kernels against each other: scalar C, SSE4.1 and AVX2, per image and per pack.

    python benchmarks/bench_resample.py [--rounds 15] [--packs 6] [--modes t2i,edit,vlm,mix] [--no-packs]

Every kernel the CPU runs (``mmidx._pixels.available_kernels()``, forced in turn with ``set_kernel``) resizes
and normalises the same images to BAGEL's sizes (``BAGEL_VIT_TRANSFORM`` / ``BAGEL_VAE_TRANSFORM``'s
``output_size``: 512² photos to the ViT's 518², upscales to the VAE's minimum side, downscales of 1536² and
larger, odd sizes), one thread, the kernels taking turns image by image over ``--rounds`` rounds
(benchmarks/common.py's protocol). Per image: each kernel's median milliseconds of CPU time, and the median
ratio of the scalar kernel's time to each SIMD kernel's with its spread over the rounds. Every kernel's output
is checked equal to the scalar kernel's (the tests check each against Pillow).

Per pack: BAGEL-budget packs (~32K tokens, benchmarks/bench_pack.py's corpus of 512² JPEGs, built once under
``--workdir``) built whole (decode, resize, normalise, token tensors) by a ``PackBuilder`` under each kernel,
taking turns pack by pack; the ratio is per round over the same packs. Decoding is the same in every kernel,
so these ratios are smaller than the per-image ones.

Where ``mmidx._pixels`` has no ``set_kernel`` (a build before the SIMD kernels), its one built-in kernel is
timed alone, so the same script gives the figures before and after the change.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from common import Watch, interleave, machine, ratio

from mmidx import _pixels
from mmidx.images.transform import BAGEL_VAE_TRANSFORM, BAGEL_VIT_TRANSFORM, ImageTransform

SOURCES = [(512, 512), (333, 517), (640, 480), (1024, 768), (1536, 1536), (1536, 1024), (2000, 1333), (4000, 3000)]
"""Stored image sizes (width, height): a 512² photo, odd and small sizes upscaled, large ones downscaled."""


def kernels() -> tuple[str, ...]:
    return _pixels.available_kernels() if hasattr(_pixels, "available_kernels") else ("built-in",)


def use(kernel: str) -> None:
    if kernel != "built-in":
        _pixels.set_kernel(kernel)


def image_cases() -> list[tuple[str, np.ndarray, torch.Tensor, ImageTransform]]:
    """(name, pixels, output buffer, transform) per source size and BAGEL transform that resizes it (a
    transform that keeps the size is left out: no resize to time)."""
    rng = np.random.default_rng(0)
    cases = []
    for width, height in SOURCES:
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        for label, transform in (("vit", BAGEL_VIT_TRANSFORM), ("vae", BAGEL_VAE_TRANSFORM)):
            new_width, new_height = (int(side) for side in transform.output_shapes(width, height, 1))
            if (new_width, new_height) == (width, height):
                continue
            cases.append((f"{width}×{height} → {new_width}×{new_height} {label}", pixels,
                          torch.empty(3, new_height, new_width), transform))
    return cases


def render(kernel: str, case: tuple) -> bytes:
    _name, pixels, out, transform = case
    use(kernel)
    return transform.normalize_into(pixels, out).numpy().tobytes()


def per_image(rounds: int) -> dict[str, list[float]]:
    """Print each image's table row; return each SIMD kernel's per-round totals' ratio inputs."""
    names = kernels()
    cases = image_cases()
    turns = interleave({name: (lambda case, name=name: render(name, case)) for name in names}, cases, rounds)
    for name in names[1:]:
        for index, case in enumerate(cases):
            if turns.results[name][index] != turns.results[names[0]][index]:
                sys.exit(f"the {name} kernel's output differs from the {names[0]} kernel's on {case[0]}")
    header = f"{'image (stored → BAGEL size)':<34}" + "".join(f" {name + ' ms':>12}" for name in names)
    header += "".join(f" {f'{names[0]} / {name}':>28}" for name in names[1:])
    print(header)
    for index, case in enumerate(cases):
        times = {name: [turns.cpu[name][r][index] for r in range(rounds)] for name in names}
        line = f"{case[0]:<34}" + "".join(f" {statistics.median(times[name]) * 1e3:>12.2f}" for name in names)
        line += "".join(f" {ratio(times[names[0]], times[name])!s:>28}" for name in names[1:])
        print(line, flush=True)
    return {name: turns.per_round(name) for name in names}


def per_pack(workdir: Path, modes: list[str], packs: int, rounds: int) -> None:
    """Print each mode's row: ms per pack per kernel and the scalar kernel's time over each SIMD kernel's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_pack import MODES, _config_and_items, prepare

    from mmidx.pack.builder import PackBuilder

    _raw, datasets = prepare(workdir)
    names = kernels()
    print(f"\n{'mode (512² JPEGs)':<18}" + "".join(f" {name + ' ms/pack':>17}" for name in names)
          + "".join(f" {f'{names[0]} / {name}':>28}" for name in names[1:]))
    for mode in modes:
        config, items = _config_and_items(datasets, MODES[mode], packs)
        builder = PackBuilder(config)

        def build(name: str, k: int, builder: PackBuilder = builder, items: list = items) -> None:
            use(name)
            builder.build(k, items[k]).to_dict()

        build(names[-1], 0)  # warm caches
        turns = interleave({name: (lambda k, name=name: build(name, k)) for name in names}, range(len(items)),
                           rounds)
        totals = {name: turns.per_round(name) for name in names}
        line = f"{mode:<18}" + "".join(
            f" {statistics.median(totals[name]) / len(items) * 1e3:>17.1f}" for name in names)
        line += "".join(f" {ratio(totals[names[0]], totals[name])!s:>28}" for name in names[1:])
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the kernels taking turns per image")
    parser.add_argument("--packs", type=int, default=6, help="packs per mode (0: no packs)")
    parser.add_argument("--pack-rounds", type=int, default=3, help="rounds of the kernels taking turns per pack")
    parser.add_argument("--modes", default="t2i,edit,vlm,mix", help="pack modes, as bench_pack.py's")
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-pack", help="bench_pack.py's corpus and datasets")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = kernels()
    print(f"# bench_resample — one thread; kernels {', '.join(names)}; {args.rounds} rounds per image, "
          f"{args.pack_rounds} per pack; CPU ms (medians over rounds); ratios: median (spread) over rounds")
    print(f"# {machine('numpy', 'torch', 'Pillow')}")
    with Watch() as watch:
        totals = per_image(args.rounds)
        if args.packs:
            per_pack(Path(args.workdir), args.modes.split(","), args.packs, args.pack_rounds)
    for name in names[1:]:
        print(f"# all images: {names[0]} / {name} = "
              + watch.headline(str(ratio(totals[names[0]], totals[name]))))
    print(f"# every kernel's pixels equal the {names[0]} kernel's on every image timed")
    print(f"# {watch.describe()}")


if __name__ == "__main__":
    main()
