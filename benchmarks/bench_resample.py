"""The Pillow-exact resize kernels against each other: scalar C, SSE4.1 and AVX2 (pmulld, pmaddwd), per image
and per pack.

    python benchmarks/bench_resample.py [--rounds 15] [--packs 6] [--modes t2i,edit,vlm,mix]   # --packs 0: images only

Every kernel the CPU runs (``mmidx._pixels.available_kernels()``, forced in turn with ``set_kernel``) resizes
and normalises the same images to BAGEL's sizes (``BAGEL_VIT_TRANSFORM`` / ``BAGEL_VAE_TRANSFORM``'s
``output_size``: 512² photos to the ViT's 518², upscales to the VAE's minimum side, downscales of 1536² and
larger, odd sizes; and a 512² photo kept at 512² for the VAE, which only normalises: the AVX2 kernel computes
the normalised values, the others look them up; each ViT image also as the pack writes it, in 14-pixel patches:
``patches_into``), one thread, the kernels taking turns image by image over
``--rounds`` rounds (benchmarks/common.py's protocol). Per image: each kernel's median milliseconds of CPU
time, and the median ratio of the scalar kernel's time to each SIMD kernel's with its spread over the rounds.
Every kernel's output is checked equal to the scalar kernel's (the tests check each against Pillow).

Per pack: BAGEL-budget packs (~32K tokens, benchmarks/bench_pack.py's corpus of 512² JPEGs, built once under
``--workdir``) built whole (decode, resize, normalise, token tensors) by a ``PackBuilder`` under each kernel,
taking turns pack by pack; the ratio is per round over the same packs. Decoding is the same in every kernel,
so these ratios are smaller than the per-image ones.

``--baseline PATH`` adds another build of the kernel (the ``mmidx/_pixels*.so`` of another checkout, e.g. one
before the SIMD kernels, or main's) as a side ``baseline`` in the same turns, per image, its output checked equal
too, and per pack (its best kernel: the transforms of the same ``PackBuilder`` call it instead, the first pack's
tensors checked equal), and prints its time over the best kernel's: the speed-up of this build over that one.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from common import Watch, interleave, machine, ratio

from mmidx import _pixels
from mmidx.images.transform import BAGEL_VAE_TRANSFORM, BAGEL_VIT_TRANSFORM, ImageTransform, _vertical_pass_first

SOURCES = [(512, 512), (333, 517), (640, 480), (1024, 768), (1536, 1536), (1536, 1024), (2000, 1333), (4000, 3000)]
"""Stored image sizes (width, height): a 512² photo, odd and small sizes upscaled, large ones downscaled."""


def kernels() -> tuple[str, ...]:
    return _pixels.available_kernels()


def load_baseline(path: str) -> ModuleType:
    """Another build of ``mmidx._pixels``, loaded beside this one from a copy under a temporary folder."""
    folder = Path(tempfile.mkdtemp())
    copy = folder / Path(path).name
    shutil.copy(path, copy)
    spec = importlib.util.spec_from_file_location("_pixels", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PATCH = 14
"""BAGEL's ViT patch: a ViT image is also timed as the pack writes it, patchified into ``packed_vit_tokens``."""


def image_cases() -> list[tuple[str, np.ndarray, torch.Tensor, ImageTransform]]:
    """(name, pixels, output buffer, transform) per source size and BAGEL transform that resizes it (a
    transform that keeps the size is left out, but for the 512² photo: normalising alone, t2i's case); each ViT
    image twice: as a (3, H, W) image and as the pack writes it, patches (a (patches, 588) output)."""
    rng = np.random.default_rng(0)
    cases = []
    for width, height in SOURCES:
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        for label, transform in (("vit", BAGEL_VIT_TRANSFORM), ("vae", BAGEL_VAE_TRANSFORM)):
            new_width, new_height = (int(side) for side in transform.output_shapes(width, height, 1))
            if (new_width, new_height) == (width, height) != (512, 512):
                continue
            name = f"{width}×{height} → {new_width}×{new_height} {label}"
            cases.append((name, pixels, torch.empty(3, new_height, new_width), transform))
            if label == "vit":
                patches = torch.empty((new_height // PATCH) * (new_width // PATCH), PATCH * PATCH * 3)
                cases.append((f"{name} patches", pixels, patches, transform))
    return cases


def render(module: ModuleType, kernel: str | None, case: tuple) -> None:
    """``ImageTransform.normalize_into``'s (or, for patches, ``patches_into``'s) call of the kernel, with
    ``module``'s kernel ``kernel`` (a baseline build, ``kernel`` None, may predate the normalise step and its
    ``normalization`` argument)."""
    _name, pixels, out, transform = case
    patches = out.dim() == 2
    height, width = (int(side) for side in transform.output_shapes(pixels.shape[1], pixels.shape[0], 1)[::-1]) \
        if patches else out.shape[1:]
    # a baseline build without the normalise step (no computes_levels) takes no normalization
    last = () if kernel is None and not hasattr(module, "computes_levels") else (transform.normalization,)
    if kernel is not None:
        module.set_kernel(kernel)
    if patches:
        module.render_patches(pixels, out.numpy(), transform.lookup_table, height, width, PATCH,
                              _vertical_pass_first(pixels, width, height), *last)
    else:
        module.render_chw(pixels, out.numpy(), transform.lookup_table, _vertical_pass_first(pixels, width, height),
                          *last)


def ratios(names: list[str]) -> list[tuple[str, str]]:
    """The ratios printed: the scalar kernel over each SIMD kernel, and a baseline build over the best kernel."""
    pairs = [(names[0], name) for name in names[1:] if name != "baseline"]
    return [*pairs, ("baseline", names[-2])] if "baseline" in names else pairs


def per_image(rounds: int, baseline: ModuleType | None) -> dict[str, list[float]]:
    """Print each image's table row; return each side's total seconds per round."""
    sides = {name: (lambda case, name=name: render(_pixels, name, case)) for name in kernels()}
    if baseline is not None:
        sides["baseline"] = lambda case: render(baseline, None, case)
    names = list(sides)
    cases = image_cases()
    for case in cases:  # outside the timing: every side's output equals the first's
        outputs = []
        for side in sides.values():
            side(case)
            outputs.append(case[2].clone())
        if not all(torch.equal(output, outputs[0]) for output in outputs):
            sys.exit(f"the kernels' outputs differ on {case[0]}")
    turns = interleave(sides, cases, rounds)
    header = f"{'image (stored → BAGEL size)':<34}" + "".join(f" {name + ' ms':>12}" for name in names)
    header += "".join(f" {f'{top} / {bottom}':>28}" for top, bottom in ratios(names))
    print(header)
    for index, case in enumerate(cases):
        times = {name: [turns.cpu[name][r][index] for r in range(rounds)] for name in names}
        line = f"{case[0]:<34}" + "".join(f" {statistics.median(times[name]) * 1e3:>12.2f}" for name in names)
        line += "".join(f" {ratio(times[top], times[bottom])!s:>28}" for top, bottom in ratios(names))
        print(line, flush=True)
    return {name: turns.per_round(name) for name in names}


def per_pack(workdir: Path, modes: list[str], packs: int, rounds: int, baseline: ModuleType | None) -> None:
    """Print each mode's row: ms per pack per kernel (and with ``baseline``, that build, its best kernel, in the
    same turns), the scalar kernel's time over each SIMD kernel's and the baseline's over the best kernel's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_pack import MODES, _config_and_items, prepare

    from mmidx.images import transform
    from mmidx.pack.builder import PackBuilder

    _raw, datasets = prepare(workdir)
    names = list(kernels()) + (["baseline"] if baseline else [])
    print(f"\n{'mode (512² JPEGs)':<18}" + "".join(f" {name + ' ms/pack':>17}" for name in names)
          + "".join(f" {f'{top} / {bottom}':>28}" for top, bottom in ratios(names)))
    for mode in modes:
        config, items = _config_and_items(datasets, MODES[mode], packs)
        builder = PackBuilder(config)

        def pack(name: str, k: int, builder: PackBuilder = builder, items: list = items) -> dict:
            transform._pixels = baseline if name == "baseline" else _pixels  # the module PackBuilder's transforms call
            if name != "baseline":
                _pixels.set_kernel(name)
            try:
                return builder.build(k, items[k]).to_dict()
            finally:
                transform._pixels = _pixels

        def build(name: str, k: int, pack=pack) -> None:
            pack(name, k)

        build(names[-1], 0)  # warm caches
        first = {name: {key: value.clone() for key, value in pack(name, 0).items() if isinstance(value, torch.Tensor)}
                 for name in names}  # copies: the batch buffers are reused
        if any(first[name].keys() != first[names[0]].keys() or
               not all(torch.equal(value, first[names[0]][key]) for key, value in first[name].items())
               for name in names):
            sys.exit(f"the kernels' {mode} packs differ")
        turns = interleave({name: (lambda k, name=name: build(name, k)) for name in names}, range(len(items)),
                           rounds)
        totals = {name: turns.per_round(name) for name in names}
        line = f"{mode:<18}" + "".join(
            f" {statistics.median(totals[name]) / len(items) * 1e3:>17.1f}" for name in names)
        line += "".join(f" {ratio(totals[top], totals[bottom])!s:>28}" for top, bottom in ratios(names))
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the kernels taking turns per image")
    parser.add_argument("--packs", type=int, default=6, help="packs per mode (0: no packs)")
    parser.add_argument("--pack-rounds", type=int, default=3, help="rounds of the kernels taking turns per pack")
    parser.add_argument("--modes", default="t2i,edit,vlm,mix", help="pack modes, as bench_pack.py's")
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-pack", help="bench_pack.py's corpus and datasets")
    parser.add_argument("--baseline", help="another build's mmidx/_pixels*.so to time beside these, per image and "
                                           "per pack")
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = load_baseline(args.baseline) if args.baseline else None
    names = list(kernels()) + (["baseline"] if baseline else [])
    print(f"# bench_resample — one thread; kernels {', '.join(names)}; {args.rounds} rounds per image, "
          f"{args.pack_rounds if args.packs else 0} per pack; CPU ms (medians over rounds); "
          "ratios: median (spread) over rounds")
    print(f"# {machine('numpy', 'torch', 'Pillow')}")
    with Watch() as watch:
        totals = per_image(args.rounds, baseline)
        if args.packs:
            per_pack(Path(args.workdir), args.modes.split(","), args.packs, args.pack_rounds, baseline)
    if baseline:
        print(f"# baseline: {args.baseline}")
    for top, bottom in ratios(names):
        print(f"# all images: {top} / {bottom} = " + watch.headline(str(ratio(totals[top], totals[bottom]))))
    print(f"# every kernel's pixels equal the {names[0]} kernel's on every image timed")
    print(f"# {watch.describe()}")


if __name__ == "__main__":
    main()
