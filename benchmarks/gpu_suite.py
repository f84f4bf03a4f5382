"""The one-shot GPU suite (issue 32): every GPU path of mmidx checked and timed in one run, report to a folder.

A session lent a GPU has 15 minutes of device time, the machine's start included, so everything runs from
one ``device`` call: ``benchmarks/gpu_suite.sh`` installs what the machine lacks from carried wheels, builds
the extension and runs this script. Each item is isolated: one that fails records its error in the report
and the next one runs. The report (``report.md``: a table per item and its checks; ``report.json``: the
same, complete) is rewritten after every item, so a run cut short still leaves what it measured.

The budget on an H100 (≤ 8 minutes by construction: fixed sizes, repeats and steps, the cost model's timing
loop stopped at ``COST_BUDGET_S``), in the order the wrapper runs them:

==========================  =======  ===========================================================
install + build (wrapper)     90 s   two carried wheels; ``pip install -e .`` compiles the kernels
1. masks                      40 s   5 packs × (12 builds × 3 methods + BAGEL's 2 × 12) + compiles
2. decode                     70 s   the 512-px corpus generated once (~30 s), 4 modes × 8 packs × 4;
                                     3 stream states × 200 decodes of 8 JPEGs (~7 s)
3. latents                    45 s   Philox/posterior checks (< 1 s); precache of ~400 images
4. feed                       60 s   ``mmidx bench`` 0/2/4/8 workers × 24 packs, one pinned batch
5. cost model                 65 s   compiles (5 lengths) + at most ``COST_BUDGET_S`` = 50 s timing
6. step                       75 s   110 steps of ~0.27 s (below) + compiles + BAGEL's masks on 11
                                     packs (~0.3 s each at H=28) + two loader starts
CUDA tests (wrapper)          30 s   tests/test_gpu_cuda.py, tests/test_device_decode.py
total                        475 s   ``run(timeout_s=540)`` leaves a rerun of one item in 15 minutes
==========================  =======  ===========================================================

Item 6's step, from FLOPs: 2 Qwen2-7B layers are 466 MFLOP a token forward (``LLMGeometry``), 103 TFLOP for
forward + backward of a 36,864-token pack (BAGEL's ``max_num_tokens``, padding included) and ~130 with
attention (the cost model's full n² per sample); at half of the H100's 989 TFLOP/s, ~0.27 s, the AdamW
step of 466M bf16 parameters (~7 GB of memory traffic) a few ms more. Two rounds of 3 warm-up + 25 timed
streamed steps, one probed for host waits, then 1 + 25 resident: 110 steps, ~30 s.

1. masks: dense masks and the BlockMask of 32K-token packs of every kind (t2i, edit, vlm, video
   generation, mix), built on the device, equal to the CPU ones element for element, and to
   ``create_block_mask`` of the same predicate; FlexAttention with the BlockMask against SDPA with the dense
   masks on the same random bf16 q/k/v (relative error of each against a float32 reference, and of one
   against the other); build times (median of ``--repeats`` after warm-up) of mmidx's dense masks and
   BlockMask, ``create_block_mask`` on mmidx's predicate, and BAGEL's own construction (its
   ``prepare_attention_mask_per_sample`` and ``create_sparse_mask`` + ``create_block_mask`` as
   ``modeling/bagel/bagel.py`` calls it, from ``--bagel-src``; absent, those columns say so).
2. decode: ``PackBuilder(decode_images="device")`` pixels against the loader path (max level difference per
   kind), images/s of both paths to the device, and torchvision's batched ``decode_jpeg`` of the same JPEGs.
   Then exactness (:func:`decode_exactness`): every pixel of the device decode of 8 JPEGs against the CPU
   decode, and 200 decodes in each state of the caller's stream (idle; busy: matrix products and reads and
   writes of freed memory queued just before; busy then drained) against the first idle one, every pixel,
   with the caller's memory checked: the iterations that differ. nvJPEG's hardware path has been reported
   to write before the caller's queued work on H100s; where it is inexact the report gives the entry that
   refuses device decode there by default (``mmidx.images.device.INEXACT_GPUS``).
3. latents: the posterior sample (``mmidx.encodings.noise``) drawn on the device against the CPU draw for
   the same (seed, pack, slot): Philox integers equal, normals and latents within float32 rounding; then
   ``mmidx precache --device`` with a randomly initialised VAE-sized encoder (:func:`vae_encoder`): images/s.
4. feed: ``mmidx bench --device`` with 0, 2, 4, 8 workers: tokens/s delivered to the device, pinned batches
   and non-blocking copies confirmed, against the tokens/s a BAGEL-7B training step consumes on this device.
5. cost model: forward+backward time of one Qwen2-7B transformer layer (``gpu_step.DecoderLayer``, FlexAttention
   with mmidx's BlockMask; ``--model qwen2-1.5b``: that model's layer) on 30 packs of each kind (fewer where
   ``COST_BUDGET_S`` stops it), against ``mmidx.index.cost.pack_costs`` (issue 37) of the pack's samples: the
   Pearson correlation, and the worst error once one least-squares factor turns predicted FLOPs into
   milliseconds; per kind, measured ÷ fitted prediction shows which kinds the model misjudges. That factor is
   written as ``calibration.json`` beside the report (:func:`mmidx.index.accelerator.write_calibration`), for
   ``mmidx bench --au --calibration``.
6. step: the step it feeds (issue 42), accelerator utilisation as MLPerf Storage reports it (time the
   accelerator computes ÷ wall time): 2 Qwen2-7B layers in bf16 with FlexAttention and mmidx's BlockMask,
   inputs assembled from the batch as BAGEL does (``gpu_step.FedStack``), forward + backward + AdamW;
   streamed (``PackLoader``, 4 workers, pinned memory, non-blocking copies, the BlockMask built per step on
   the device) against resident (the same packs and masks already there), 50 timed steps each: utilisation
   = resident ÷ streamed, the host's time per phase, host waits for the device, mmidx's mask time, and
   BAGEL's per-forward ``create_block_mask`` on the same packs (ms a step, share of the step).

On the GPU machine (one ``device`` run; the wheels' recipe is in ``benchmarks/gpu_suite.sh``)::

    run(command="bash benchmarks/gpu_suite.sh", carry=[".whl", ".bagel"], timeout_s=540)

On any machine, a rehearsal without CUDA in about a minute (tests/test_gpu_suite.py runs it)::

    python benchmarks/gpu_suite.py /tmp/gpu-report --device cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bagel_peer import MODES
from bench_masks import ALL_KINDS, bagel_pack
from common import commit, machine
from gpu_step import (
    DecoderLayer,
    Fed,
    FedStack,
    Run,
    compiled_flex,
    dense_attend,
    flex_attend,
    full_mask,
    replayed,
    timed_steps,
    train_step,
)

from mmidx.pack.masks import block_mask, dense_masks, mask_predicate

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
BLOCK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
IMAGE_KEYS = ("padded_images", "packed_vit_tokens")
DECODE_MODES = ("t2i", "edit", "vlm", "mix")  # the generated corpus has no video-generation source
QWEN2_7B = {"params": 7.6e9, "layers": 28, "hidden": 3584, "heads": 28, "head_dim": 128}
QUICK_ATTENTION = ("t2i", "mix")  # a quick CPU run compares attention on these only (eager flex is slow there)
ASSUMED_MFU = 0.4  # a well-run BAGEL-7B step's model FLOPs utilisation, for the tokens/s it consumes


@dataclass
class Item:
    """One item's outcome: its table, its checks (name, passed, detail) and notes, or the error that ended it."""

    name: str
    columns: list[str] = field(default_factory=list)
    rows: list[list[Any]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    status: str = "ok"
    error: str | None = None
    seconds: float = 0.0

    def check(self, name: str, passed: bool, detail: str = "") -> None:
        self.checks.append({"name": name, "passed": bool(passed), "detail": detail})


@dataclass
class Suite:
    """What every item needs: the device, the sizes (quick or full), and the shared work folder."""

    device: str
    quick: bool
    tokens: int
    repeats: int
    workdir: Path
    bagel_src: str | None
    out: Path  # the report's folder: the cost model's calibration file goes there too
    model: str = "qwen2-7b"  # the geometry whose layer the cost model times (mmidx.index.accelerator.MODELS)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def median_ms(self, function: Callable[[], Any], repeats: int | None = None) -> float:
        """Median wall time of ``repeats`` calls after two warm-ups (none in a quick run: its figures only prove
        that the code runs), the device's queue drained around each."""
        for _ in range(0 if self.quick else 2):
            function()
        self.sync()
        times = []
        for _ in range(repeats or self.repeats):
            start = time.perf_counter()
            result = function()
            self.sync()
            times.append(time.perf_counter() - start)
            del result
        return statistics.median(times) * 1e3


def vae_encoder() -> torch.nn.Module:
    """A randomly initialised encoder of a latent-diffusion VAE's size and shape (FLUX's: 8x down, 16 latent
    channels, ~34M parameters): the cost ``mmidx precache`` pays per image with a real VAE."""
    return _VAEEncoder((128, 256, 512, 512))


def small_vae_encoder() -> torch.nn.Module:
    """The same shape at a sixteenth of the width, for ``--quick`` rehearsals on a CPU."""
    return _VAEEncoder((8, 16, 32, 32))


class _Resnet(torch.nn.Module):
    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.norm1 = torch.nn.GroupNorm(min(32, inputs // 4), inputs)
        self.conv1 = torch.nn.Conv2d(inputs, outputs, 3, 1, 1)
        self.norm2 = torch.nn.GroupNorm(min(32, outputs // 4), outputs)
        self.conv2 = torch.nn.Conv2d(outputs, outputs, 3, 1, 1)
        self.skip = torch.nn.Conv2d(inputs, outputs, 1) if inputs != outputs else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(torch.nn.functional.silu(self.norm1(x)))
        return self.skip(x) + self.conv2(torch.nn.functional.silu(self.norm2(h)))


class _VAEEncoder(torch.nn.Module):
    """conv_in, two ResNet blocks per level with a stride-2 conv between levels (three: 8x), a mid block, then
    (mean, logvar) of 16 channels each: the layout of the SD/FLUX VAE encoders."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, widths[0], 3, 1, 1)]
        for level, width in enumerate(widths):
            layers += [_Resnet(layers[-1].out_channels if level == 0 else widths[level - 1], width),
                       _Resnet(width, width)]
            if level < len(widths) - 1:
                layers.append(torch.nn.Conv2d(width, width, 3, 2, 1))
        layers += [_Resnet(widths[-1], widths[-1]), torch.nn.GroupNorm(32 if widths[-1] >= 128 else 8, widths[-1]),
                   torch.nn.SiLU(), torch.nn.Conv2d(widths[-1], 32, 3, 1, 1)]
        self.layers = torch.nn.Sequential(*layers)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, logvar = self.layers(images).chunk(2, dim=1)
        return mean, logvar.clamp(-30, 20)


# ---------------------------------------------------------------------------------------------- 1. masks


def _bagel_masks(bagel_src: str | None) -> tuple[Any, Any] | str:
    """BAGEL's ``prepare_attention_mask_per_sample`` and ``create_sparse_mask`` from its ``data.data_utils``,
    or why they are not available."""
    if not bagel_src:
        return "no --bagel-src: BAGEL's own construction not timed"
    if bagel_src not in sys.path:
        sys.path.insert(0, bagel_src)
    try:
        from data.data_utils import create_sparse_mask, prepare_attention_mask_per_sample
    except ImportError as error:
        return f"BAGEL's data.data_utils not importable from {bagel_src}: {error}"
    return prepare_attention_mask_per_sample, create_sparse_mask


def bagel_block_mask(create_sparse_mask: Callable[..., Any], layout: tuple, heads: int, suite: Suite) -> Any:
    """BAGEL's BlockMask of a pack as ``modeling/bagel/bagel.py`` builds it in every forward: its
    ``create_sparse_mask`` of the split metadata, then ``create_block_mask(B=1, H=heads, BLOCK_SIZE=128,
    _compile=True)`` over the whole pack (compiled on CUDA only: a CPU run rehearses it eagerly)."""
    from torch.nn.attention.flex_attention import create_block_mask

    split_lens, attn_modes, sample_lens = layout
    length = sum(sample_lens)
    return create_block_mask(create_sparse_mask(sample_lens, split_lens, attn_modes, suite.device), B=1, H=heads,
                             Q_LEN=length, KV_LEN=length, device=suite.device, BLOCK_SIZE=128, _compile=suite.cuda)


def _same_blocks(got: Any, expected: Any) -> bool:
    """Every block list of the two BlockMasks equal; where ``expected`` has several heads (BAGEL builds one per
    attention head), ``got``'s one head equals each."""
    for name in BLOCK_FIELDS:
        a, b = getattr(got, name).cpu(), getattr(expected, name).cpu()
        if a.shape != b.shape and a.shape[1] == 1 and a.shape[2:] == b.shape[2:]:
            a = a.expand_as(b)
        if not torch.equal(a, b):
            return False
    return True


def _relative(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.float() - reference.float()).norm() / reference.float().norm())


def _attention(suite: Suite, item: Item, kind: str, layout: tuple, masks: list[torch.Tensor], blocks: Any,
               flex: Callable[..., torch.Tensor]) -> str:
    """FlexAttention with the BlockMask against per-sample SDPA with the dense masks, both bf16, each against a
    float32 reference: the proof that the two masks encode the same attention."""
    heads, dim = (1, 64) if suite.quick else (4, 128)
    generator = torch.Generator(device=suite.device).manual_seed(ALL_KINDS.index(kind))
    q, k, v = (torch.randn(1, heads, suite.tokens, dim, generator=generator, device=suite.device,
                           dtype=torch.bfloat16) for _ in range(3))
    flex_out = flex(q, k, v, block_mask=blocks)
    sdpa_out, reference = torch.empty_like(q), torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for mask in masks:
        end = start + mask.shape[0]
        part = slice(start, end)
        sdpa_out[:, :, part] = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, part], k[:, :, part], v[:, :, part], attn_mask=mask.to(torch.bfloat16))
        reference[:, :, part] = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, part].float(), k[:, :, part].float(), v[:, :, part].float(), attn_mask=mask)
        start = end
    flex_error, sdpa_error = _relative(flex_out, reference), _relative(sdpa_out, reference)
    between = _relative(flex_out, sdpa_out)
    finite = bool(torch.isfinite(flex_out).all() and torch.isfinite(sdpa_out).all())
    item.check(f"{kind}: FlexAttention (BlockMask) = SDPA (dense masks) within bf16 tolerance",
               finite and between < 1e-2 and flex_error < 1e-2 and sdpa_error < 1e-2,
               f"relative error flex {flex_error:.1e}, SDPA {sdpa_error:.1e} (vs float32), flex vs SDPA "
               f"{between:.1e}; {heads} heads of {dim}")
    return f"{between:.1e}"


def item_masks(suite: Suite, item: Item) -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    bagel = _bagel_masks(suite.bagel_src)
    if isinstance(bagel, str):
        item.notes.append(bagel)
    bagel_heads = 2 if suite.quick else QWEN2_7B["heads"]
    flex = torch.compile(flex_attention) if suite.cuda else flex_attention  # eager flex is the reference path
    item.columns = ["pack", "samples", "splits", "dense = CPU", "BlockMask = CPU", "= create_block_mask",
                    "= BAGEL", "flex vs SDPA", "dense ms", "BlockMask ms", "create_block_mask ms",
                    "BAGEL dense ms", f"BAGEL BlockMask ms (H={bagel_heads})"]
    if suite.quick:
        item.notes.append(f"quick run: attention compared on {', '.join(QUICK_ATTENTION)} only, no warm-ups")
    item.notes.append(f"{suite.tokens}-token packs; times: median of {suite.repeats} after 2 warm-ups, on "
                      f"{suite.device}, device drained around each; BAGEL BlockMask = create_sparse_mask + "
                      f"create_block_mask(B=1, H={bagel_heads}, BLOCK_SIZE=128, _compile={suite.cuda}) as "
                      "modeling/bagel/bagel.py calls it")
    for kind in ALL_KINDS:
        layout = bagel_pack(kind, suite.tokens, seed=1)
        split_lens, _, sample_lens = layout
        length = sum(sample_lens)
        dense = dense_masks(*layout, device=suite.device)
        cpu_dense = dense_masks(*layout, device="cpu")
        dense_equal = all(torch.equal(a.cpu(), b) for a, b in zip(dense, cpu_dense, strict=True))
        del cpu_dense
        blocks = block_mask(*layout, device=suite.device)
        blocks_equal = _same_blocks(blocks, block_mask(*layout, device="cpu"))
        predicate = mask_predicate(*layout, device=suite.device)

        def reference(predicate=predicate, length=length):
            return create_block_mask(predicate, None, None, length, length, device=suite.device, BLOCK_SIZE=128)

        reference_equal = _same_blocks(blocks, reference())
        item.check(f"{kind}: dense masks on {suite.device} = on the CPU, element for element", dense_equal)
        item.check(f"{kind}: BlockMask on {suite.device} = on the CPU, every block list", blocks_equal)
        item.check(f"{kind}: BlockMask = create_block_mask of the same predicate", reference_equal)
        bagel_cells = ["-", "n/a", "n/a"] if isinstance(bagel, str) else \
            _against_bagel(suite, item, kind, layout, dense, blocks, bagel, bagel_heads)
        agreement = "-"
        if not suite.quick or kind in QUICK_ATTENTION:
            agreement = _attention(suite, item, kind, layout, dense, blocks, flex)
        del dense
        timings = [suite.median_ms(lambda layout=layout: dense_masks(*layout, device=suite.device)),
                   suite.median_ms(lambda layout=layout: block_mask(*layout, device=suite.device)),
                   suite.median_ms(reference)]
        item.rows.append([kind, len(sample_lens), len(split_lens), _yes(dense_equal), _yes(blocks_equal),
                          _yes(reference_equal), bagel_cells[0], agreement, *(f"{t:.2f}" for t in timings),
                          *bagel_cells[1:]])
        if suite.cuda:
            torch.cuda.empty_cache()


def _against_bagel(suite: Suite, item: Item, kind: str, layout: tuple, dense: list[torch.Tensor], blocks: Any,
                   bagel: tuple[Any, Any], heads: int) -> list[str]:
    """BAGEL's own masks of the pack: equal to mmidx's (dense, and the BlockMask's block lists), and their
    build times (dense per sample; its BlockMask as modeling/bagel/bagel.py builds it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    per_sample, sparse = bagel
    split_lens, attn_modes, sample_lens = layout
    length = sum(sample_lens)
    bounds, first = [], 0
    for sample_len in sample_lens:  # each sample's splits, as BAGEL's packer hands them over
        last, total = first, 0
        while total < sample_len:
            total += split_lens[last]
            last += 1
        bounds.append((first, last))
        first = last

    def bagel_dense() -> list[torch.Tensor]:
        return [per_sample(split_lens[a:b], attn_modes[a:b], device=suite.device) for a, b in bounds]

    def bagel_blocks() -> Any:
        return bagel_block_mask(sparse, layout, heads, suite)

    same = all(torch.equal(a, b) for a, b in zip(bagel_dense(), dense, strict=True))
    same_blocks = _same_blocks(blocks, create_block_mask(sparse(sample_lens, split_lens, attn_modes, suite.device),
                                                         None, None, length, length, device=suite.device,
                                                         BLOCK_SIZE=128))
    item.check(f"{kind}: mmidx's masks = BAGEL's (dense, and BlockMask block lists)", same and same_blocks)
    return [_yes(same and same_blocks), f"{suite.median_ms(bagel_dense):.2f}", f"{suite.median_ms(bagel_blocks):.2f}"]


def _yes(value: bool) -> str:
    return "yes" if value else "NO"


# ---------------------------------------------------------------------------------------------- 2. decode


QUICK_PACKING = {"expected_num_tokens": 2048, "max_num_tokens": 3072, "max_num_tokens_per_sample": 2048,
                 "prefer_buffer_before": 1024, "max_buffer_size": 50}


def corpus(suite: Suite) -> tuple[Path, Path]:
    """The generated BAGEL-style corpus (photo-like JPEGs; ``bagel_peer.prepare``) and the data YAML of its
    mmidx datasets: BAGEL's budgets and image sizes, or in a quick run small packs of images of 8 to 16 strides
    a side (112-224 px for the ViT, 128-256 px for the VAE)."""
    import yaml
    from bagel_peer import BUDGETS, DROPOUT, prepare

    raw, datasets = prepare(suite.workdir / "corpus", image_size=256 if suite.quick else 512)
    spec = yaml.safe_load((datasets / "data.yaml").read_text())
    spec.update(packing=QUICK_PACKING if suite.quick else BUDGETS, dropout=DROPOUT)
    if suite.quick:  # each transform keeps its stride (BAGEL's: 16-px VAE, 14-px ViT: vlm_sft's only transform)
        for group in spec["groups"].values():
            for key in ("image_transform_args", "vit_image_transform_args"):
                if key in group:
                    stride = group[key]["image_stride"]
                    group[key].update(max_image_size=16 * stride, min_image_size=8 * stride)
    path = datasets / ("quick.yaml" if suite.quick else "suite.yaml")
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return raw, path


def _config(data_yaml: Path, groups: list[str]) -> Any:
    """The DataConfig of the data YAML's ``groups`` only."""
    import yaml

    from mmidx.config import DataConfig

    spec = yaml.safe_load(data_yaml.read_text())
    return DataConfig.from_dict({**spec, "groups": {g: spec["groups"][g] for g in groups}}, base_dir=data_yaml.parent)


def _config_and_items(data_yaml: Path, groups: list[str], packs: int) -> tuple[Any, list[Any]]:
    from mmidx.index.pack_index import build_pack_index

    config = _config(data_yaml, groups)
    index = build_pack_index(config, num_samples=packs * 40)
    return config, [index.items(k) for k in range(min(packs, len(index) - 1))]


DECODE_ITERATIONS = 200  # decodes in each state of the caller's stream (a quick run: 3)
DECODE_STALL_MS = 10  # the work a busy decode finds queued ahead of it (torchvision's decode call takes ~1 ms)
DECODE_STATES = ("idle", "busy", "drained")


def decode_exactness(datas: list[np.ndarray], reference: list[torch.Tensor], device: str, state: str,
                     iterations: int, stall: Callable[[], None],
                     decode: Callable[[list[np.ndarray], str], list[torch.Tensor]] | None = None) -> dict[str, int]:
    """Decode ``datas`` (``decode``: ``mmidx.images.device.decode_jpeg_batch``) ``iterations`` times on ``device``
    and count the iterations whose pixels differ, in any pixel, from ``reference`` (a decode made on the idle
    device), and those in which the caller's memory was damaged.

    ``state`` is the caller's stream at each decode: "idle" (drained); "busy": ``stall()``, then for each
    image a tensor of its size filled with a known byte, summed and then zeroed, all queued on the caller's
    stream and the tensors freed before the decode, which the caching allocator may hand their blocks (a
    decoder that writes before the queued work has run makes the sums wrong and its pixels zero: nvJPEG's
    hardware path on H100s, meta-pytorch/torchcodec#1634, pytorch/vision#9606); "drained": the same, with
    the stream drained before the decode (whether draining is a remedy). Returns {"iterations", "pixels
    differ", "memory damaged", "inexact" (either)}.
    """
    from mmidx.images.device import decode_jpeg_batch

    decode = decode or decode_jpeg_batch
    cuda = torch.device(device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.current_stream(device).synchronize()

    differ = damaged = inexact = 0
    for _ in range(iterations):
        sync()
        sums, expected = [], []
        if state != "idle":
            victims = [torch.full((image.numel(),), k + 1, dtype=torch.uint8, device=device)
                       for k, image in enumerate(reference)]
            sync()
            stall()
            for k, victim in enumerate(victims):
                sums.append(victim.sum(dtype=torch.int64))
                expected.append((k + 1) * victim.numel())
                victim.zero_()
            del victims, victim
            if state == "drained":
                sync()
        got = decode(datas, device)
        sync()
        pixels = not all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
        memory = any(int(total) != value for total, value in zip(sums, expected, strict=True))
        differ, damaged, inexact = differ + pixels, damaged + memory, inexact + (pixels or memory)
    return {"iterations": iterations, "pixels differ": differ, "memory damaged": damaged, "inexact": inexact}


def _stall(suite: Suite) -> Callable[[], None]:
    """Work for the caller's stream: a chain of matrix products lasting about ``DECODE_STALL_MS`` on a GPU
    (one small product on a CPU, where work is not queued)."""
    size, dtype = (4096, torch.bfloat16) if suite.cuda else (64, torch.float32)
    a = torch.randn(size, size, device=suite.device, dtype=dtype)
    out = torch.empty_like(a)
    count = math.ceil(DECODE_STALL_MS / suite.median_ms(lambda: torch.mm(a, a, out=out), 5)) if suite.cuda else 1

    def stall() -> None:
        for _ in range(count):
            torch.mm(a, a, out=out)
    return stall


def _decode_exactness_checks(suite: Suite, item: Item, datas: list[np.ndarray]) -> None:
    """Item 2's exactness: every pixel of the device decode against the CPU decode, and decodes with the caller's
    stream idle, busy and drained against the idle one, ``DECODE_ITERATIONS`` times each."""
    from mmidx.images.device import decode_jpeg_batch

    iterations = 3 if suite.quick else DECODE_ITERATIONS
    cpu = decode_jpeg_batch(datas, "cpu")
    suite.sync()
    reference = decode_jpeg_batch(datas, suite.device)
    suite.sync()
    differing = sum(int((a.cpu() != b).any(dim=0).sum()) for a, b in zip(reference, cpu, strict=True))
    worst = max(int((a.cpu().int() - b.int()).abs().max()) for a, b in zip(reference, cpu, strict=True))
    pixels = sum(image.shape[1] * image.shape[2] for image in cpu)
    item.notes.append(f"device decode against the CPU decode (PIL), every pixel of {len(datas)} JPEGs: "
                      f"{differing:,} of {pixels:,} pixels differ, by at most {worst} levels"
                      + (" (nvJPEG's IDCT and chroma upsampling are not libjpeg's)" if suite.cuda else "")
                      + "; each decode below is compared with the device's first idle one, so with the CPU decode by "
                      "the same pixels")
    stall = _stall(suite)
    for state in DECODE_STATES:
        counts = decode_exactness(datas, reference, suite.device, state, iterations, stall)
        item.check(f"device decode, caller's stream {state}: every pixel equal to the idle decode, caller's "
                   "memory intact", counts["inexact"] == 0,
                   f"{counts['pixels differ']} of {iterations} iterations differ in pixels, {counts['memory damaged']} "
                   f"damaged the caller's queued memory; {len(datas)} JPEGs a decode"
                   + (f", {DECODE_STALL_MS} ms of matrix products queued" if state != "idle" and suite.cuda else ""))
        if state == "busy" and counts["inexact"] and suite.cuda:
            name = torch.cuda.get_device_name(suite.device)
            item.notes.append(f"to refuse device decode on this GPU by default, list it in "
                              f"mmidx.images.device.INEXACT_GPUS: {name!r}: \"the GPU suite at {commit()}: "
                              f"{counts['inexact']} of {iterations} decodes with the caller's stream busy were "
                              f"inexact (torch {torch.__version__}, torchvision {version('torchvision')})\"")


@contextlib.contextmanager
def _device_decode_allowed(suite: Suite, item: Item) -> Iterator[None]:
    """Measure the device decode even where mmidx refuses it (a GPU in ``INEXACT_GPUS``), saying so."""
    from mmidx.images.device import ALLOW_VARIABLE, INEXACT_GPUS

    reason = INEXACT_GPUS.get(torch.cuda.get_device_name(suite.device)) if suite.cuda else None
    if reason is None:
        yield
        return
    item.notes.append(f"this GPU is listed as inexact ({reason}): measured with {ALLOW_VARIABLE}=allow")
    before = os.environ.get(ALLOW_VARIABLE)
    os.environ[ALLOW_VARIABLE] = "allow"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ALLOW_VARIABLE]
        else:
            os.environ[ALLOW_VARIABLE] = before


def item_decode(suite: Suite, item: Item) -> None:
    with _device_decode_allowed(suite, item):
        _measure_decode(suite, item)


def _measure_decode(suite: Suite, item: Item) -> None:
    from mmidx.images.device import decode_jpeg_batch
    from mmidx.pack.builder import PackBuilder

    raw, data_yaml = corpus(suite)
    packs, rounds = (2, 1) if suite.quick else (8, 3)
    item.columns = ["pack", "packs", "images", "max level difference", "loader path images/s",
                    "device path images/s", "device ÷ loader", "batched decode_jpeg images/s"]
    item.notes.append(f"images/s: packs built and moved to {suite.device} (loader path: decoded and resized in the "
                      "builder; device path: encoded bytes moved, decoded and resized there), median of "
                      f"{rounds} rounds; "
                      "batched decode_jpeg: torchvision's decoder alone on the same JPEGs (anchor: ~7,800 "
                      "images/s on an A100, pytorch/vision#8496); the generated corpus has no video generation")
    jpegs = sorted((raw / "vlm" / "images").glob("*.jpg"))
    for mode in DECODE_MODES:
        config, items = _config_and_items(data_yaml, MODES[mode], packs)
        loader, device = PackBuilder(config), PackBuilder(config, decode_images="device")
        worst, images = 0.0, 0
        for k, pack in enumerate(items):
            expected = loader.build(k, pack).to(suite.device).to_dict()
            got = device.build(k, pack).to(suite.device).to_dict()
            for key in IMAGE_KEYS:
                if key in expected:
                    images += len(expected.get("patchified_vae_latent_shapes", [])) if key == "padded_images" \
                        else len(expected["vit_token_seqlens"])
                    worst = max(worst, float((got[key].float() - expected[key].float()).abs().max()) * 127.5)
        item.check(f"{mode}: device-decoded pixels within 2 levels of the loader's (resize tolerance)", worst <= 2.0,
                   f"max difference {worst:.2f} levels")

        def build_all(builder, items=items):
            for k, pack in enumerate(items):
                builder.build(k, pack).to(suite.device)

        rates = [images / suite.median_ms(lambda b=b: build_all(b), rounds) * 1e3 for b in (loader, device)]
        item.rows.append([mode, len(items), images, f"{worst:.2f}", f"{rates[0]:.0f}", f"{rates[1]:.0f}",
                          f"{rates[1] / rates[0]:.2f}", ""])
    datas = [torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8) for path in jpegs[:64]]
    if suite.cuda:
        from torchvision.io import ImageReadMode, decode_jpeg

        rate = len(datas) / suite.median_ms(lambda: decode_jpeg(datas, mode=ImageReadMode.RGB, device=suite.device),
                                            5) * 1e3
    else:  # what decode_jpeg_batch does without CUDA: PIL per image
        rate = len(datas) / suite.median_ms(lambda: decode_jpeg_batch([d.numpy() for d in datas], suite.device),
                                            3) * 1e3
    item.rows.append(["JPEGs alone", "-", len(datas), "-", "-", "-", "-", f"{rate:.0f}"])
    _decode_exactness_checks(suite, item, [data.numpy() for data in datas[:8]])


# ---------------------------------------------------------------------------------------------- 3. latents


def item_latents(suite: Suite, item: Item) -> None:
    from mmidx.encodings.noise import philox4x32, sample_latents

    generator = torch.Generator().manual_seed(3)
    counter = [torch.randint(0, 2**32, (1 << 16,), generator=generator, dtype=torch.int64) for _ in range(4)]
    key = (0x12345678, 0x9ABCDEF0)
    on_cpu, on_device = philox4x32(counter, key), philox4x32([c.to(suite.device) for c in counter], key)
    item.check("Philox4x32-10 integers on the device = on the CPU",
               all(torch.equal(a, b.cpu()) for a, b in zip(on_cpu, on_device, strict=True)))
    worst_abs, worst_rel, draws = 0.0, 0.0, 0
    for seed, pack in ((0, 0), (7, 123456789), (2**40 + 5, 2**33 + 1)):
        sizes = torch.randint(8, 65, (6, 2), generator=generator)
        moments = torch.zeros(6, 2, 16, 64, 64, dtype=torch.bfloat16)
        for slot, (h, w) in enumerate(sizes.tolist()):
            moments[slot, :, :, :h, :w] = torch.randn(2, 16, h, w, generator=generator).to(torch.bfloat16)
        keys = torch.tensor([seed, pack])
        cpu = sample_latents(moments, sizes, keys)
        got = sample_latents(moments.to(suite.device), sizes.to(suite.device), keys.to(suite.device)).cpu()
        difference = (got - cpu).abs()
        worst_abs = max(worst_abs, float(difference.max()))
        worst_rel = max(worst_rel, float((difference / (cpu.abs() + 1)).max()))
        draws += 1
    item.check("posterior sample on the device = the CPU draw within float32 rounding", worst_rel <= 1e-5,
               f"{draws} packs of 6 slots: max |difference| {worst_abs:.1e}, relative {worst_rel:.1e}")
    item.columns = ["what", "value"]
    item.rows += [["max |device - CPU| of the latents", f"{worst_abs:.2e}"],
                  ["max |device - CPU| / (1 + |CPU|)", f"{worst_rel:.2e}"]]

    _, data_yaml = corpus(suite)
    if suite.quick:  # a rehearsal: the t2i images only (64), at 64-128 px
        import yaml

        spec = yaml.safe_load(data_yaml.read_text())
        group = spec["groups"]["t2i_pretrain"]
        group["image_transform_args"].update(max_image_size=128, min_image_size=64)
        data_yaml = data_yaml.with_name("quick_precache.yaml")
        data_yaml.write_text(yaml.safe_dump({**spec, "groups": {"t2i_pretrain": group}}, sort_keys=False))
    factory = "gpu_suite:small_vae_encoder" if suite.quick else "gpu_suite:vae_encoder"
    name = f"gpusuite_vae_{int(time.time())}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mmidx.cli", "precache", str(data_yaml), "--encoder",
                           factory, "--name", name, "--device", suite.device, "--batch-size", "16", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"mmidx precache failed: {done.stderr.strip()[-800:]}")
    records = sum(int(line.split(":", 1)[1].split()[0]) for line in done.stdout.splitlines() if line.startswith(name))
    item.check("mmidx precache wrote an encoding for every image", records > 0, done.stdout.strip()[-300:])
    item.rows += [[f"mmidx precache --device {suite.device} ({factory.split(':')[1]}, batch 16): images", records],
                  ["the same: images/s (whole command: start-up, model load, decode, encode, write)",
                   f"{records / seconds:.1f}"]]
    item.notes.append(f"encodings of {data_yaml}'s datasets; the command took {seconds:.1f} s")


# ---------------------------------------------------------------------------------------------- 4. feed


def _bf16_tflops(suite: Suite) -> float:
    """The device's measured matrix-product rate (8192³ bf16 on CUDA; 1024³ float32 on a CPU), in TFLOP/s."""
    size, dtype = (8192, torch.bfloat16) if suite.cuda else (1024, torch.float32)
    a, b = (torch.randn(size, size, device=suite.device, dtype=dtype) for _ in range(2))
    return 2 * size**3 / suite.median_ms(lambda: a @ b, 10) / 1e9


def bagel_step_tokens_per_s(tflops: float, mean_keys: float) -> float:
    """Tokens/s a BAGEL-7B training step consumes at ``ASSUMED_MFU`` of ``tflops``: 6 FLOPs per parameter per
    token (forward and backward, one expert of the MoT active per token), plus attention's 12 · layers · hidden
    FLOPs per attended key."""
    per_token = 6 * QWEN2_7B["params"] + 12 * QWEN2_7B["layers"] * QWEN2_7B["hidden"] * mean_keys
    return ASSUMED_MFU * tflops * 1e12 / per_token


def item_feed(suite: Suite, item: Item) -> None:
    from mmidx.pack.builder import PackBuilder
    from mmidx.train.loader import PackDataset, PackLoader

    _, data_yaml = corpus(suite)
    workers = "0,2" if suite.quick else "0,2,4,8"
    packs = 4 if suite.quick else 24
    done = subprocess.run([sys.executable, "-m", "mmidx.cli", "bench", str(data_yaml), "--device",
                           suite.device, "--workers", workers, "--packs", str(packs), "--json"],
                          capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH",
                                                                                                   "")])})
    if done.returncode != 0:
        raise RuntimeError(f"mmidx bench failed: {done.stderr.strip()[-800:]}")
    result = json.loads(done.stdout)
    tflops = _bf16_tflops(suite)
    masks = dense_masks(*bagel_pack("mix", suite.tokens, seed=1), device=suite.device)
    mean_keys = sum(float((mask == 0).sum()) for mask in masks) / suite.tokens
    consumed = bagel_step_tokens_per_s(tflops, mean_keys)
    item.columns = ["workers", "packs", "tokens/s to the device", "packs/s", "MB/s", "÷ BAGEL-7B step's tokens/s"]
    for row in result["rows"]:
        item.rows.append([row["workers"], row["packs"], f"{row['tokens_per_s']:.0f}", f"{row['packs_per_s']:.2f}",
                          f"{row['mb_per_s']:.0f}", f"{row['tokens_per_s'] / consumed:.1f}"])
    item.notes.append(f"mmidx bench {data_yaml} --device {suite.device} --workers {workers} --packs "
                      f"{packs} (t2i+edit+vlm mix, flex masks on the device); BAGEL-7B step: {consumed:.0f} tokens/s "
                      f"= {ASSUMED_MFU:.0%} of the measured {tflops:.0f} TFLOP/s over 6·7.6e9 + 12·28·3584·"
                      f"{mean_keys:.0f} FLOPs a token (mean attended keys of a {suite.tokens}-token mix pack)")
    item.check("mmidx bench moves batches with non-blocking copies from pinned memory on CUDA",
               result.get("non_blocking") == suite.cuda and result.get("pin_memory") == suite.cuda,
               f"bench reports pin_memory={result.get('pin_memory')}, non_blocking={result.get('non_blocking')}")
    if suite.cuda:
        config = _config(data_yaml, MODES["mix"])
        from mmidx.index.pack_index import build_pack_index

        loader = PackLoader(PackDataset(build_pack_index(config, num_samples=80), PackBuilder(config)),
                            global_batch_size=1, num_workers=2, pin_memory=True)
        batch = next(iter(loader))
        pinned = all(tensor.is_pinned() for tensor in batch.tensors.values())
        start = time.perf_counter()
        moved = batch.to(suite.device, non_blocking=True)
        issued = time.perf_counter() - start
        suite.sync()
        total = time.perf_counter() - start
        item.check("a PackLoader(pin_memory=True) batch is pinned, every tensor", pinned)
        size = sum(tensor.numel() * tensor.element_size() for tensor in moved.tensors.values())
        item.notes.append(f"one pinned batch's non-blocking move: issued in {issued * 1e3:.2f} ms, on the device "
                          f"after {total * 1e3:.2f} ms ({size / 1e6:.0f} MB)")


# ---------------------------------------------------------------------------------------------- 5. cost model

COST_PACKS = 30  # packs of each kind (a quick run: 1)
COST_FRACTIONS = (0.5, 0.625, 0.75, 0.875, 1.0)  # pack lengths, as fractions of --tokens (a quick run: 1.0 only)
COST_BUDGET_S = 50  # timing stops at the first round of kinds after this (150 packs × 5 runs of ~80 ms: ~60 s)


def _fitting_pack(kind: str, length: int, seed: int) -> tuple[list[int], list[str], list[int]]:
    """``bagel_pack(kind, length)`` of the first seed from ``seed`` on (step 100,000) whose first sample fits."""
    for attempt in range(100):
        try:
            return bagel_pack(kind, length, seed=seed + 100_000 * attempt)
        except ValueError:
            continue
    raise ValueError(f"no {kind} pack of {length} tokens in 100 seeds: give longer packs (--tokens)")


def _layer_agreement(suite: Suite, item: Item, layer: DecoderLayer, layout: tuple,
                     flex_attend: Callable[[tuple], Callable[..., torch.Tensor]],
                     dense_attend: Callable[[tuple], Callable[..., torch.Tensor]], gradient: torch.Tensor) -> None:
    """The timed layer computes the pack's attention: its output (and on CUDA its input gradient) with
    FlexAttention and the BlockMask equals the same with SDPA and the dense mask, within bf16 tolerance. On a
    CPU (no FlexAttention backward) the outputs only."""
    results = []
    for attend in (flex_attend(layout), dense_attend(layout)):
        x = gradient.detach().clone().requires_grad_(suite.cuda)
        with torch.set_grad_enabled(suite.cuda):
            out = layer(x, attend)
            if suite.cuda:
                out.backward(gradient)
        results.append((out.detach(), x.grad))
    (flex_out, flex_grad), (sdpa_out, sdpa_grad) = results
    errors = [_relative(flex_out, sdpa_out)] + ([_relative(flex_grad, sdpa_grad)] if suite.cuda else [])
    item.check("the layer with FlexAttention (BlockMask) = with SDPA (dense mask): output"
               + (" and input gradient" if suite.cuda else ""), max(errors) < 2e-2,
               f"relative difference {', '.join(f'{e:.1e}' for e in errors)}; a {sum(layout[2])}-token mix pack")


def item_cost_model(suite: Suite, item: Item) -> None:
    """Forward+backward time of one transformer layer (Qwen2-7B's; a small one in a quick run) with FlexAttention
    on ``COST_PACKS`` packs of each kind, against ``mmidx.index.cost.pack_costs`` of the pack's samples (one
    attention segment each, the padding pseudo-sample one more): the correlation, and the worst error once
    the predicted FLOPs are scaled to seconds by one least-squares factor over all packs."""
    import dataclasses

    from torch.nn.attention.flex_attention import flex_attention

    from mmidx.index.accelerator import MODELS, write_calibration
    from mmidx.index.cost import LLMGeometry, pack_costs

    geometry = dataclasses.replace(MODELS[suite.model].geometry, num_layers=1) if not suite.quick else \
        LLMGeometry(hidden_size=64, num_layers=1, ffn_size=128, num_heads=4, num_kv_heads=2)
    dtype = torch.bfloat16 if suite.cuda else torch.float32
    layer = DecoderLayer(geometry).to(suite.device, dtype)
    attention = compiled_flex() if suite.cuda else flex_attention
    count = 1 if suite.quick else COST_PACKS
    lengths = [suite.tokens] if suite.quick else [int(suite.tokens * f) // 128 * 128 for f in COST_FRACTIONS]
    generator = torch.Generator().manual_seed(5)
    gradients = {n: torch.randn(1, n, geometry.hidden_size, generator=generator).to(suite.device, dtype)
                 for n in lengths}
    finite = True

    def flex_of(layout: tuple) -> Callable[..., torch.Tensor]:
        return flex_attend(block_mask(*layout, device=suite.device), attention)

    def dense_of(layout: tuple) -> Callable[..., torch.Tensor]:
        return dense_attend(full_mask(dense_masks(*layout, device=suite.device), dtype))

    def step(layout: tuple) -> Callable[[], None]:
        n = sum(layout[2])
        # FlexAttention has no backward on a CPU: there SDPA with the pack's dense mask rehearses the rest
        attend = flex_of(layout) if suite.cuda else dense_of(layout)
        x = gradients[n].detach().clone().requires_grad_(True)

        def forward_backward() -> None:
            nonlocal finite
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x, attend).backward(gradients[n])
            finite = finite and bool(torch.isfinite(x.grad).all())
        return forward_backward

    for n in lengths:  # compile (on CUDA) each pack length before anything is timed
        step(_fitting_pack("mix", n, 0))()
    suite.sync()
    # short: SDPA with grouped heads and an arbitrary mask may take the math path (28 heads × n² scores), and
    # eager flex on a CPU is slow
    agreement = _fitting_pack("mix", 8192 if suite.cuda else 2048, 0)
    _layer_agreement(suite, item, layer, agreement, flex_of, dense_of,
                     gradients[lengths[0]][:, :sum(agreement[2])])
    kinds, tokens, predicted, measured = [], [], [], []
    began = time.perf_counter()
    for k in range(count):  # kinds interleaved, so a budget cut leaves every kind measured alike
        if time.perf_counter() - began > COST_BUDGET_S:
            item.notes.append(f"time budget of {COST_BUDGET_S} s reached: {k} packs of each kind, not {count}")
            break
        for kind in ALL_KINDS:
            layout = _fitting_pack(kind, lengths[k % len(lengths)], 1000 + k)
            sample_lens = layout[2]
            predicted.append(float(pack_costs(np.array([0, len(sample_lens)]), np.array(sample_lens), geometry)[0]))
            measured.append(suite.median_ms(step(layout), 1 if suite.quick else 3))
            kinds.append(kind)
            tokens.append(sum(sample_lens))
    predicted_a, measured_a, tokens_a = np.array(predicted), np.array(measured), np.array(tokens)
    scale = float(predicted_a @ measured_a / (predicted_a @ predicted_a))  # ms per predicted FLOP
    errors = np.abs(scale * predicted_a - measured_a) / measured_a
    correlation = float(np.corrcoef(predicted_a, measured_a)[0, 1]) if len(set(measured)) > 1 else float("nan")
    item.check("forward+backward ran on every pack, input gradients finite", finite and np.isfinite(measured_a).all())
    item.columns = ["packs", "count", "mean tokens", "mean predicted GFLOP (fwd)", "mean measured ms (fwd+bwd)",
                    "measured ÷ fitted prediction", "worst error"]
    for kind in [*ALL_KINDS, "all"]:
        mine = np.array([kind in ("all", k) for k in kinds])
        item.rows.append([kind, int(mine.sum()), f"{tokens_a[mine].mean():.0f}",
                          f"{predicted_a[mine].mean() / 1e9:.4g}", f"{measured_a[mine].mean():.2f}",
                          f"{(measured_a[mine] / (scale * predicted_a[mine])).mean():.3f}",
                          f"{errors[mine].max():.1%}"])
    item.rows.append(["correlation (Pearson, all packs)", len(measured), "", "", "", "", f"{correlation:.3f}"])
    device = torch.cuda.get_device_name(suite.device) if suite.cuda else "cpu (a rehearsal: SDPA, float32)"
    write_calibration(suite.out / "calibration.json", scale * 1e-3, geometry,
                      attention="flex" if suite.cuda else "sdpa", device=device, packs=len(measured),
                      correlation=None if np.isnan(correlation) else correlation, worst_error=float(errors.max()),
                      source=f"benchmarks/gpu_suite.py cost_model at commit {commit()}"
                             + (" (--quick: a small layer, no model's)" if suite.quick else ""))
    item.notes.append(f"calibration.json: {scale * 1e-3:.3g} s per FLOP; mmidx bench DATA.yaml --au --model "
                      f"{suite.model} --calibration {suite.out / 'calibration.json'}")
    item.notes.append(f"one layer: hidden {geometry.hidden_size}, FFN {geometry.ffn_size}, {geometry.num_heads} "
                      f"heads, {geometry.num_kv_heads} KV heads, {dtype}, "
                      + ("compiled FlexAttention with mmidx's BlockMask" if suite.cuda else
                         "SDPA with the pack's dense mask (FlexAttention has no backward on a CPU)")
                      + f"; pack lengths "
                      f"{', '.join(map(str, lengths))} tokens in turn; measured: median of "
                      f"{1 if suite.quick else 3} forward+backward runs; prediction: pack_costs with one layer, "
                      f"scaled by one least-squares factor ({scale * 1e9:.3g} ms per GFLOP); the model counts "
                      "full n² attention per segment, causal and noise splits attend less")


# ---------------------------------------------------------------------------------------------- 6. the step it feeds

STEP_LAYERS = 2  # decoder layers of the fed step (Qwen2-7B has QWEN2_7B["layers"])
STEP_TIMED = 50  # timed steps of each side (a quick run: 2)
STEP_ROUNDS = 2  # streamed, then resident on the same packs, this many times over fresh packs
STEP_WARMUP = 3  # untimed steps before each streamed run (the loader's start; the first compiles); resident: 1
STEP_WORKERS = 4  # loader workers (a quick run: 2)
BAGEL_MASK_PACKS = 10  # fed packs BAGEL's per-forward create_block_mask is timed on (a quick run: 2)
FULL_UTILISATION = 0.99


def _per_pack_ms(suite: Suite, build: Callable[[tuple], Any], layouts: list[tuple]) -> tuple[float, list[Any]]:
    """Mean wall time of ``build(layout)`` over ``layouts``, once each after one warm-up (it compiles), the device
    drained around each; and what each built."""
    build(layouts[0])
    suite.sync()
    times, built = [], []
    for layout in layouts:
        start = time.perf_counter()
        built.append(build(layout))
        suite.sync()
        times.append(time.perf_counter() - start)
    return statistics.fmean(times) * 1e3, built


def _sync_count(suite: Suite, work: Callable[[], Any]) -> tuple[int, Any]:
    """How often ``work()`` made the host wait for the device (``torch.cuda.set_sync_debug_mode``), and its result."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught), result


def item_step(suite: Suite, item: Item) -> None:
    """The step it feeds: utilisation of a training step of ``STEP_LAYERS`` Qwen2-7B layers (``gpu_step``) fed by
    a PackLoader, = resident step time ÷ streamed step time over the same packs, with what holds it back and
    BAGEL's per-forward mask construction on the same packs."""
    from mmidx.index.cost import LLMGeometry, pack_costs
    from mmidx.pack.builder import PackBuilder
    from mmidx.toolkit.bench import pack_index_holding
    from mmidx.train.loader import PackDataset, PackLoader

    _, data_yaml = corpus(suite)
    timed, warmup = (STEP_ROUNDS, 1) if suite.quick else (STEP_TIMED, STEP_WARMUP)
    per_round = timed // STEP_ROUNDS
    geometry = LLMGeometry(hidden_size=64, num_layers=STEP_LAYERS, ffn_size=128, num_heads=4, num_kv_heads=2) \
        if suite.quick else LLMGeometry(num_layers=STEP_LAYERS)
    dtype = torch.bfloat16 if suite.cuda else torch.float32
    config = _config(data_yaml, MODES["mix"])
    index = pack_index_holding(config, STEP_ROUNDS * (warmup + per_round + 1), None)
    # FlexAttention has no backward on a CPU: there the loader's batches carry dense masks, and SDPA trains
    loader = PackLoader(PackDataset(index, PackBuilder(config, use_flex=suite.cuda)), global_batch_size=1,
                        num_workers=2 if suite.quick else STEP_WORKERS, pin_memory=suite.cuda, device=suite.device)
    with torch.device(suite.device):  # initialised there: a 152064-row embedding is seconds of a CPU's time
        model = FedStack(geometry, config.geometry.vit_patch_size, config.geometry.vae_image_downsample).to(dtype)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                                  fused=True if suite.cuda else None)

    def fed(batch: Any) -> Fed:
        """What a trainer does with a batch it receives: build its masks on its device."""
        masks = batch.attention_masks(dtype=dtype)
        if suite.cuda:
            return Fed(batch, masks.seq_lengths[0], flex_attend(masks))
        return Fed(batch, batch.sequence_length, dense_attend(full_mask(masks, dtype)))

    def step(pack: Fed) -> torch.Tensor:
        return train_step(model, optimizer, pack.batch.tensors, pack.length, pack.attend)

    sides = {"streamed": Run(), "resident": Run()}
    layouts: list[tuple] = []
    syncs = {}
    for _ in range(STEP_ROUNDS):
        batches = iter(loader)
        streamed = timed_steps(batches, fed, per_round, warmup, step, suite.sync)
        if suite.cuda and not syncs:  # one more streamed step, its host waits counted
            syncs["next batch"], batch = _sync_count(suite, lambda batches=batches: next(batches))
            syncs["masks"], pack = _sync_count(suite, lambda batch=batch: fed(batch))
            syncs["step"], _ = _sync_count(suite, lambda pack=pack: step(pack))
        batches.close()
        resident = timed_steps(iter(replayed(streamed, warmup)), lambda pack: pack, per_round, 1, step, suite.sync)
        for side, run in zip(sides.values(), (streamed, resident), strict=True):
            side.steps += run.steps
            side.seconds += run.seconds
            side.compiled += run.compiled
            side.losses += run.losses
            for phase, seconds in run.host.items():
                side.host[phase] += seconds
        layouts += [pack.batch.flat_split_metadata(pad=True) for pack in streamed.packs[warmup:]]
        del streamed, resident
    streamed_ms, resident_ms = (side.seconds / side.steps * 1e3 for side in sides.values())
    utilisation = resident_ms / streamed_ms
    losses = torch.stack([loss for side in sides.values() for loss in side.losses])
    item.check("every step's loss finite (streamed and resident)", bool(torch.isfinite(losses).all()),
               f"{len(losses)} steps")
    if suite.cuda:
        compiled = {name: side.compiled for name, side in sides.items()}
        item.check("nothing compiled during a timed step (every pack one compiled shape)",
                   not any(compiled.values()), f"frames compiled: {compiled}")
    samples = layouts[::max(1, len(layouts) // (2 if suite.quick else BAGEL_MASK_PACKS))]
    mmidx_ms, mmidx_masks = _per_pack_ms(suite, lambda layout: block_mask(*layout, device=suite.device), samples)
    # the sequence the model ran: padded to the BlockMask's length on CUDA, the samples alone with dense masks
    segments = [layout[2] if suite.cuda else layout[2][:-1] for layout in layouts]
    flops = 3 * sum(float(pack_costs(np.array([0, len(lens)]), np.array(lens), geometry)[0]) for lens in segments)
    depth = QWEN2_7B["layers"] / STEP_LAYERS
    item.columns = ["figure", "value"]
    item.rows += [
        ["packs timed on each side", f"{timed} ({STEP_ROUNDS} rounds of {per_round}, after {warmup} warm-up steps "
                                     "streamed, 1 resident)"],
        ["tokens a pack (mean: its samples; the sequence run)",
         f"{statistics.fmean(sum(layout[2][:-1]) for layout in layouts):.0f}; "
         f"{statistics.fmean(map(sum, segments)):.0f}"],
        ["step ms, streamed", f"{streamed_ms:.2f}"],
        ["step ms, resident", f"{resident_ms:.2f}"],
        ["utilisation = resident ÷ streamed", f"{utilisation:.4f}"],
        ["held back: (streamed - resident) ÷ streamed", f"{1 - utilisation:.2%}"],
        [f"mmidx's block_mask ms a step ({len(samples)} of the packs, device drained around each)", f"{mmidx_ms:.2f}"],
        ["  its share of the streamed step (at most: as if it overlapped nothing)", f"{mmidx_ms / streamed_ms:.2%}"],
        *([[f"host ms a streamed step: {phase}", f"{seconds / sides['streamed'].steps * 1e3:.2f}"]
           for phase, seconds in sides["streamed"].host.items()]),
        ["host ms a resident step: step issued",
         f"{sides['resident'].host['step issued'] / sides['resident'].steps * 1e3:.2f}"],
        [f"utilisation at {QWEN2_7B['layers']} layers (lower bound: the streamed excess kept per step)",
         f"{depth * resident_ms / (depth * resident_ms + max(0.0, streamed_ms - resident_ms)):.4f}"],
        ["model TFLOP/s of the resident step (3 × pack_costs)", f"{flops / (timed * resident_ms / 1e3) / 1e12:.3g}"],
    ]
    if syncs:
        item.rows.append([f"host waits for the device in one streamed step: {', '.join(syncs)}",
                          ", ".join(map(str, syncs.values()))])
    bagel = _bagel_masks(suite.bagel_src)
    if isinstance(bagel, str):
        item.notes.append(bagel)
    else:
        def bagel_blocks(layout: tuple) -> Any:
            return bagel_block_mask(bagel[1], layout, geometry.num_heads, suite)

        bagel_ms, bagel_masks = _per_pack_ms(suite, bagel_blocks, samples)
        item.check("on the fed packs, mmidx's BlockMask = BAGEL's, every block list",
                   all(map(_same_blocks, mmidx_masks, bagel_masks)), f"{len(samples)} packs")
        item.rows += [
            [f"BAGEL's create_block_mask ms a step (H={geometry.num_heads}, the same packs)", f"{bagel_ms:.2f}"],
            ["  its share of this step (÷ resident step + it)", f"{bagel_ms / (resident_ms + bagel_ms):.2%}"],
            [f"  its share of a {QWEN2_7B['layers']}-layer step", f"{bagel_ms / (depth * resident_ms + bagel_ms):.2%}"],
        ]
    item.notes += [
        f"{STEP_LAYERS} decoder layers of hidden {geometry.hidden_size}, FFN {geometry.ffn_size}, {geometry.num_heads} "
        f"heads, {geometry.num_kv_heads} KV heads, {dtype}; inputs as BAGEL assembles them (gpu_step.FedStack); "
        "forward + backward + AdamW; " + ("compiled FlexAttention with the batch's BlockMask" if suite.cuda else
                                          "SDPA with the batch's dense masks (FlexAttention has no backward on a CPU)"),
        f"streamed: PackLoader, {loader.num_workers} workers, pin_memory={loader.pin_memory}, batches moved with "
        f"non_blocking={loader.pin_memory}, masks built per step on {suite.device}; resident: the same packs already "
        "there, with their masks; each side's time from a drained device to a drained device, means over the timed "
        "steps; host ms: the host's time in each phase of the loop (where it waited, the device may have computed)",
        f"the {STEP_LAYERS}-layer step consumes tokens {depth:.0f}x as fast as Qwen2-7B's {QWEN2_7B['layers']} layers: "
        "a stress test of the loader; at full depth the loader's excess is at most what it is here, hence the "
        "lower bound",
    ]
    if utilisation < FULL_UTILISATION:
        item.notes.append(f"utilisation {utilisation:.4f} < {FULL_UTILISATION}: {1 - utilisation:.1%} of the streamed "
                          f"step held back, of which mmidx's masks at most {mmidx_ms / streamed_ms:.1%}; the rest is "
                          "the loader (waits for a batch, its copies)")


ITEMS: dict[str, Callable[[Suite, Item], None]] = {
    "masks": item_masks, "decode": item_decode, "latents": item_latents, "feed": item_feed,
    "cost_model": item_cost_model, "step": item_step,
}


# ---------------------------------------------------------------------------------------------- the report


def environment(suite: Suite) -> dict[str, Any]:
    info = {"commit": commit(), "machine": machine("torch", "torchvision", "Pillow", "numpy"),
            "device": suite.device, "torch": torch.__version__, "quick": suite.quick, "tokens": suite.tokens,
            "repeats": suite.repeats}
    if suite.bagel_src and (Path(suite.bagel_src) / "COMMIT").exists():
        info["bagel_commit"] = (Path(suite.bagel_src) / "COMMIT").read_text().strip()
    if suite.cuda:
        props = torch.cuda.get_device_properties(suite.device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    multiprocessors=props.multi_processor_count)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown (nvidia-smi did not answer)"
    return info


def markdown(info: dict[str, Any], items: list[Item]) -> str:
    lines = ["# mmidx GPU suite", "", *(f"- {key}: {value}" for key, value in info.items()), ""]
    for item in items:
        lines += [f"## {item.name} — {item.status} ({item.seconds:.1f} s)", ""]
        if item.error:
            lines += ["```text", item.error, "```", ""]
        if item.rows:
            lines += ["| " + " | ".join(item.columns) + " |", "|" + "---|" * len(item.columns)]
            lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in item.rows]
            lines.append("")
        lines += [f"- {'PASS' if c['passed'] else 'FAIL'}: {c['name']}" + (f" ({c['detail']})" if c["detail"] else "")
                  for c in item.checks]
        lines += [f"- note: {note}" for note in item.notes]
        lines.append("")
    return "\n".join(lines)


def write_report(out: Path, info: dict[str, Any], items: list[Item]) -> None:
    (out / "report.json").write_text(json.dumps({"environment": info, "items": [vars(i) for i in items]}, indent=1))
    (out / "report.md").write_text(markdown(info, items))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for report.md and report.json (created)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes: a CPU rehearsal in under a minute")
    parser.add_argument("--tokens", type=int, help="pack length for the masks (default 32768; --quick 4096)")
    parser.add_argument("--repeats", type=int, help="timed runs per figure (default 10; --quick 1)")
    parser.add_argument("--items", nargs="+", choices=list(ITEMS), default=list(ITEMS))
    parser.add_argument("--bagel-src", help="a folder holding BAGEL's data package (data/__init__.py, "
                                            "data/data_utils.py), for its own mask construction")
    parser.add_argument("--workdir", type=Path, help="the generated corpus (default: a temporary folder)")
    parser.add_argument("--model", default="qwen2-7b", choices=["qwen2-7b", "qwen2-1.5b"],
                        help="the model whose layer the cost model item times (its calibration.json is for it)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as scratch:
        suite = Suite(device=args.device, quick=args.quick, tokens=args.tokens or (4096 if args.quick else 32768),
                      repeats=args.repeats or (1 if args.quick else 10), workdir=args.workdir or Path(scratch),
                      bagel_src=args.bagel_src, out=args.out, model=args.model)
        info, items = environment(suite), []
        print(f"gpu_suite: {info}", flush=True)
        for name in args.items:
            item = Item(name)
            items.append(item)
            start = time.perf_counter()
            try:
                ITEMS[name](suite, item)
            except Exception as error:  # one item's failure is recorded and the suite goes on
                item.status, item.error = "error", "".join(traceback.format_exception(error)[-6:]).strip()
            item.seconds = time.perf_counter() - start
            if item.status == "ok" and not all(check["passed"] for check in item.checks):
                item.status = "failed checks"
            print(f"gpu_suite: {name}: {item.status} in {item.seconds:.1f} s", flush=True)
            write_report(args.out, info, items)
            if suite.cuda:
                torch.cuda.empty_cache()
    print(markdown(info, items))
    return 0 if all(item.status == "ok" for item in items) else 1


if __name__ == "__main__":
    sys.exit(main())
