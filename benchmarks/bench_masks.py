"""Cost of mmidx.pack.masks on realistic 32K-token BAGEL packs, against the floors that matter.

Dense masks are compared with merely storing their bytes into a reused buffer of the kind they are written
into (``mmidx.pack.buffers.mask_buffer``): with the masks' own streaming stores (the same masks with every
sample one full split, so every row is one run: the memory-bound floor of the masks) and with glibc's
``memset`` (ordinary stores, which read every line before writing it); and with allocating and filling
tensors of the same shapes as torch allocates them (fresh 4 KiB pages for every pack: what a mask built
with torch's allocator, BAGEL's, pays at least). The BlockMask is compared with ``create_block_mask`` of the
same predicate (``--with-create-block-mask``: about 20 s and 10 GB per pack on a CPU). Peak memory is the
rise of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) over its resident set
before the build: tensors are not seen by tracemalloc; dense masks are written into memory the process
already holds (the pool's buffers, the size of its largest packs' masks), so the table gives the masks'
own bytes instead. Every run starts with freed memory handed back to the system (malloc_trim), so what is
not pooled pays for fresh pages, as a data loader making new masks every step does. The dense build, its
floors and the BlockMask take turns pack by pack over ``--repeats`` rounds, the first rotating
(``common.interleave``); CPU times are the process's CPU seconds of a build and of freeing its result,
medians over rounds, and the ratio is the median of the per-round ratios with its range, which holds up
on a shared machine. The load average and other processes' cores are recorded, and the headline ratios
are withheld when other processes kept over half a core busy. With CUDA, all masks of a pack are also
timed on the GPU (wall clock, synchronised).

    python benchmarks/bench_masks.py [--repeats 5] [--threads N] [--with-create-block-mask]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import random
import re
import statistics
import time
from collections.abc import Callable

import torch
from common import Watch, interleave, machine, ratio
from torch.nn.attention.flex_attention import create_block_mask

from mmidx.pack.buffers import mask_buffer
from mmidx.pack.masks import block_mask, dense_masks, mask_predicate

KINDS = ("t2i", "edit", "vlm")
ALL_KINDS = (*KINDS, "video", "mix")  # video generation, and a mix of all four source types


def bagel_pack(kind: str, total: int, seed: int = 0) -> tuple[list[int], list[str], list[int]]:
    """Samples of one source type (BAGEL's token counts) until ``total``, then the padding pseudo-sample.

    ``kind`` is one of ``ALL_KINDS``: "video" is video generation (a caption, the clean first frame, then
    groups of noised frames, one noise split each); "mix" draws each sample's type from the other four.
    """
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> tuple[int, str]:  # <|im_start|> ids <|im_end|>
        return rng.randint(lo, hi) + 2, "causal"

    def vae(mode: str) -> tuple[int, str]:  # 512..1024 px sides, 16 px latents, start/end tokens
        return rng.choice([32, 40, 48, 64]) * rng.choice([32, 40, 48, 64]) + 2, mode

    def vit(side: list[int]) -> tuple[int, str]:  # 14 px patches
        return rng.choice(side) * rng.choice(side) + 2, "full"

    split_lens: list[int] = []
    attn_modes: list[str] = []
    sample_lens: list[int] = []
    draws = 0
    while True:
        this = rng.choice(ALL_KINDS[:4]) if kind == "mix" else kind
        if this == "t2i":
            sample = [text(10, 150), vae("noise")]
        elif this == "video":  # caption, clean first frame, 2-3 groups of 1-2 noised frames of 32x32 latents
            sample = [text(10, 150), vae("full")]
            sample += [(rng.randint(1, 2) * 32 * 32 + 2, "noise") for _ in range(rng.randint(2, 3))]
        elif this == "edit":  # clean start image, then one or two edit steps
            sample = [vae("full"), vit([16, 27, 37])]
            for step in range(rng.randint(1, 2)):
                sample += [text(5, 60), vae("noise")]
                if step == 0:
                    sample += [vae("full"), vit([16, 27, 37])]
        else:  # turns of human text, maybe an image, and an answer
            sample = []
            for _ in range(rng.randint(1, 4)):
                if rng.random() < 0.7:
                    sample.append(vit([27, 37, 50, 70]))
                sample += [text(5, 150), text(20, 800)]
        length = sum(size for size, _ in sample)
        if sum(sample_lens) + length > total:
            if sample_lens:
                break
            if (draws := draws + 1) == 1000:
                raise ValueError(f"no {kind} sample fits in {total} tokens: give a longer pack")
            continue  # a first sample longer than a short pack: draw another
        split_lens += [size for size, _ in sample]
        attn_modes += [mode for _, mode in sample]
        sample_lens.append(length)
    padding = total - sum(sample_lens)
    return [*split_lens, padding], [*attn_modes, "causal"], [*sample_lens, padding]




def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+) kB", status.read()).group(1))


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap back to the system, so no run reuses another's pages."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def peak_extra_mib(build: Callable[[], object]) -> float | None:
    """Rise of the peak resident set while ``build`` runs and its result is alive, in MiB."""
    release_freed_memory()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current resident set
    except OSError:
        return None
    before = _status_kib("VmRSS")
    result = build()
    peak = _status_kib("VmHWM") - before
    del result
    return peak / 1024


def seconds(build: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    """Wall seconds of ``build`` (synchronised by ``sync``), its result freed after the clock stops."""
    release_freed_memory()
    sync()
    start = time.perf_counter()
    result = build()
    sync()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def cpu_seconds(build: Callable[[], object]) -> float:
    """CPU seconds of this process building ``build``'s result and freeing it, as a loader does every step
    (page faults and unmapping are the process's system time)."""
    release_freed_memory()
    start = time.process_time()
    build()
    return time.process_time() - start


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def fill(sample_lens: list[int]) -> list[torch.Tensor]:
    """Tensors of a pack's dense mask shapes, allocated by torch (4 KiB pages) and filled."""
    return [torch.full((n, n), float("-inf")) for n in sample_lens]


def mask_bytes(sample_lens: list[int]) -> int:
    """Bytes of a pack's float32 dense masks."""
    return sum(n * n for n in sample_lens) * 4


def one_run_masks(sample_lens: list[int]) -> list[torch.Tensor]:
    """The floor of the masks: their bytes stored as dense_masks stores them, every row one run (one full split
    per sample), into the masks' reused buffers."""
    return dense_masks(sample_lens, ["full"] * len(sample_lens), sample_lens, device="cpu")


def memset_reused(sample_lens: list[int]) -> object:
    """The masks' bytes stored by glibc's memset (ordinary stores) into a reused buffer of the masks' pool."""
    buffer = mask_buffer(mask_bytes(sample_lens))
    ctypes.memset(buffer.ctypes.data, 0xFF, buffer.nbytes)
    return buffer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768, help="pack length (default 32768)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (default 5)")
    parser.add_argument("--kinds", nargs="+", default=[*KINDS, "mix"], choices=ALL_KINDS)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--with-create-block-mask", action="store_true", help="also time create_block_mask")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    print(f"machine: {machine('torch')} ({torch.get_num_threads()} threads){gpu}")
    print(f"packs: {args.tokens} tokens; the dense build, its floors and the BlockMask take turns pack by pack "
          f"over {args.repeats} rounds (CPU ms, median, lowest–highest); memory = peak RSS rise\n")
    layouts = {kind: bagel_pack(kind, args.tokens) for kind in args.kinds}
    builds = {
        "dense": {kind: functools.partial(dense_masks, *layout, device="cpu") for kind, layout in layouts.items()},
        "fill": {kind: functools.partial(fill, layout[2]) for kind, layout in layouts.items()},
        "stores": {kind: functools.partial(one_run_masks, layout[2]) for kind, layout in layouts.items()},
        "memset": {kind: functools.partial(memset_reused, layout[2]) for kind, layout in layouts.items()},
        "BlockMask": {kind: functools.partial(block_mask, *layout, device="cpu") for kind, layout in layouts.items()},
    }
    timed: dict[str, dict[str, list[float]]] = {side: {kind: [] for kind in layouts} for side in builds}

    def side(name: str) -> Callable[[str], None]:
        def run(kind: str) -> None:  # its own clock, started after freed memory is handed back
            timed[name][kind].append(cpu_seconds(builds[name][kind]))
        return run

    with Watch() as watch:
        for per_kind in builds.values():
            for build in per_kind.values():
                build()  # warm up
        interleave({name: side(name) for name in builds}, list(layouts), args.repeats)
        memory = {name: {kind: peak_extra_mib(builds[name][kind]) for kind in layouts}
                  for name in ("fill", "BlockMask")}
        reference = {}
        if args.with_create_block_mask:
            for kind, layout in layouts.items():
                def create(layout=layout):
                    return create_block_mask(mask_predicate(*layout, device="cpu"), None, None, sum(layout[2]),
                                             sum(layout[2]), device="cpu")
                reference[kind] = (f"{seconds(create) * 1e3:.0f}", mib(peak_extra_mib(create)))
    print(
        "| pack | samples | splits | dense ms | stores ms (floor) | dense ÷ stores | memset ms | fill ms (torch's "
        "allocation) | dense ÷ fill | masks MiB | fill MiB | BlockMask ms | BlockMask MiB | create_block_mask ms "
        "| create_block_mask MiB |"
    )
    print("|" + "---|" * 15)
    ratios = {}
    for kind, (split_lens, _, sample_lens) in layouts.items():
        dense_ms, fill_ms, stores_ms, memset_ms, blocks_ms = (statistics.median(timed[name][kind]) * 1e3
                                                               for name in builds)
        ratios[kind] = ratio(timed["dense"][kind], timed["stores"][kind])
        reference_ms, reference_mib = reference.get(kind, ("-", "-"))
        print(
            f"| {kind} | {len(sample_lens)} | {len(split_lens)} | {dense_ms:.1f} | {stores_ms:.1f} | {ratios[kind]} "
            f"| {memset_ms:.1f} | {fill_ms:.1f} | {ratio(timed['dense'][kind], timed['fill'][kind])} "
            f"| {mask_bytes(sample_lens) / 2**20:.0f} | {mib(memory['fill'][kind])} "
            f"| {blocks_ms:.1f} | {mib(memory['BlockMask'][kind])} | {reference_ms} | {reference_mib} |"
        )
    print(f"\n{watch.describe()}")
    for kind, value in ratios.items():
        text = f"{kind}: dense masks cost {value} storing their bytes (every row one run) into reused memory"
        print(f"headline: {watch.headline(text)}")

    if torch.cuda.is_available():
        print("\n| pack (CUDA) | dense bf16 ms | fill bf16 ms | BlockMask ms | all masks ms |")
        print("|" + "---|" * 5)
        for kind in args.kinds:
            layout = bagel_pack(kind, args.tokens)

            def gpu_dense(layout=layout):
                return dense_masks(*layout, device="cuda", dtype=torch.bfloat16)

            def gpu_fill(sample_lens=layout[2]):
                shape = {"dtype": torch.bfloat16, "device": "cuda"}
                return [torch.full((n, n), -torch.inf, **shape) for n in sample_lens]

            def gpu_blocks(layout=layout):
                return block_mask(*layout, device="cuda")

            def gpu_all(dense=gpu_dense, blocks=gpu_blocks):
                return dense(), blocks()

            times = []
            for build in (gpu_dense, gpu_fill, gpu_blocks, gpu_all):
                build()
                times.append(statistics.median(seconds(build, torch.cuda.synchronize) for _ in range(20)))
            print(f"| {kind} | " + " | ".join(f"{t * 1e3:.2f}" for t in times) + " |")


if __name__ == "__main__":
    main()
