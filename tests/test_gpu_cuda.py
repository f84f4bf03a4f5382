"""CPU against CUDA, element for element: what the GPU suite (benchmarks/gpu_suite.py) checks, as tests.

Every test here needs a CUDA GPU and is skipped without one (saying so): skipped is never passing. The
suite's wrapper (benchmarks/gpu_suite.sh) runs this file on a lent GPU machine; the CPU halves of these
equalities are proven against references in test_masks.py, test_precache.py and test_device_decode.py.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_masks import ALL_KINDS, bagel_pack
from gpu_suite import decode_exactness

from mmidx.encodings.noise import philox4x32, sample_latents
from mmidx.images.device import INEXACT_GPUS, DeviceDecodeError, decode_jpeg_batch
from mmidx.pack.masks import block_mask, dense_masks, mask_predicate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (CPU-vs-CUDA equalities): run on a lent GPU machine through "
                                       "benchmarks/gpu_suite.sh; a skip here is not a pass")

TOKENS = 8192
BLOCK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_dense_masks_on_cuda_equal_the_cpu_ones(kind):
    layout = bagel_pack(kind, TOKENS, seed=2)
    for dtype in (torch.float32, torch.bfloat16):
        got = dense_masks(*layout, device="cuda", dtype=dtype)
        expected = dense_masks(*layout, device="cpu", dtype=dtype)
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert a.is_cuda and torch.equal(a.cpu(), b)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_block_mask_on_cuda_equals_the_cpu_one_and_create_block_mask(kind):
    from torch.nn.attention.flex_attention import create_block_mask

    layout = bagel_pack(kind, TOKENS, seed=3)
    got = block_mask(*layout, device="cuda")
    cpu = block_mask(*layout, device="cpu")
    reference = create_block_mask(mask_predicate(*layout, device="cuda"), None, None, TOKENS, TOKENS, device="cuda")
    for name in BLOCK_FIELDS:
        assert torch.equal(getattr(got, name).cpu(), getattr(cpu, name)), name
        assert torch.equal(getattr(got, name), getattr(reference, name)), name


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_flex_attention_with_the_block_mask_equals_sdpa_with_the_dense_masks(kind):
    from torch.nn.attention.flex_attention import flex_attention

    layout = bagel_pack(kind, TOKENS, seed=4)
    generator = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 2, TOKENS, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
               for _ in range(3))
    flex = torch.compile(flex_attention)(q, k, v, block_mask=block_mask(*layout, device="cuda"))
    sdpa, start = torch.full_like(q, float("nan")), 0
    for mask in dense_masks(*layout, device="cuda", dtype=torch.bfloat16):
        part = slice(start, start + mask.shape[0])
        sdpa[:, :, part] = torch.nn.functional.scaled_dot_product_attention(q[:, :, part], k[:, :, part],
                                                                            v[:, :, part], attn_mask=mask)
        start += mask.shape[0]
    assert torch.isfinite(flex).all() and torch.isfinite(sdpa).all()
    assert float((flex.float() - sdpa.float()).norm() / sdpa.float().norm()) < 1e-2


def test_philox_integers_on_cuda_equal_the_cpu_ones():
    generator = torch.Generator().manual_seed(6)
    counter = [torch.randint(0, 2**32, (4096,), generator=generator, dtype=torch.int64) for _ in range(4)]
    key = (0xDEADBEEF, 0x01234567)
    for a, b in zip(philox4x32(counter, key), philox4x32([c.cuda() for c in counter], key), strict=True):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize(("seed", "pack"), [(0, 0), (11, 987654321), (2**40 + 3, 2**33 + 7)])
def test_the_posterior_sample_on_cuda_equals_the_cpu_draw_within_float32_rounding(seed, pack):
    generator = torch.Generator().manual_seed(seed % 1000)
    sizes = torch.randint(4, 33, (5, 2), generator=generator)
    moments = torch.zeros(5, 2, 16, 32, 32, dtype=torch.bfloat16)
    for slot, (h, w) in enumerate(sizes.tolist()):
        moments[slot, :, :, :h, :w] = torch.randn(2, 16, h, w, generator=generator).to(torch.bfloat16)
    key = torch.tensor([seed, pack])
    cpu = sample_latents(moments, sizes, key)
    got = sample_latents(moments.cuda(), sizes.cuda(), key.cuda())
    assert got.is_cuda and got.dtype == torch.float32
    assert float(((got.cpu() - cpu).abs() / (cpu.abs() + 1)).max()) <= 1e-5
    assert torch.equal(got.cpu() == 0, cpu == 0)  # the padding is zero on both


def test_device_decoded_pixels_on_cuda_are_within_resize_tolerance_of_the_loader(tmp_path):
    from support.packing import build_groups, config_of

    from mmidx.index.pack_index import build_pack_index
    from mmidx.pack.builder import PackBuilder

    config = config_of(build_groups(tmp_path, photo=True))
    index = build_pack_index(config, num_samples=40)
    exact, deferred = PackBuilder(config), PackBuilder(config, decode_images="device")
    compared = 0
    for k in range(len(index)):
        expected = exact.build(k, index.items(k)).to_dict()
        got = deferred.build(k, index.items(k)).to("cuda").to_dict()
        for key in ("padded_images", "packed_vit_tokens"):
            if key in expected:
                assert got[key].is_cuda and got[key].shape == expected[key].shape
                # nvJPEG's IDCT differs from libjpeg's by a level or two before the resize
                assert float((got[key].cpu() - expected[key]).abs().max()) <= 4 / 127.5 + 1e-6, key
                compared += 1
    assert compared


def test_loader_batches_are_pinned_and_move_to_cuda_unchanged_with_non_blocking_copies(tmp_path):
    from support.packing import build_groups, config_of

    from mmidx.index.pack_index import build_pack_index
    from mmidx.pack.builder import PackBuilder
    from mmidx.train.loader import PackDataset, PackLoader

    config = config_of(build_groups(tmp_path))
    dataset = PackDataset(build_pack_index(config, num_samples=20), PackBuilder(config))
    pinned = next(iter(PackLoader(dataset, global_batch_size=1, num_workers=1, pin_memory=True)))
    assert pinned.tensors and all(tensor.is_pinned() for tensor in pinned.tensors.values())
    moved = pinned.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    for key, tensor in pinned.tensors.items():
        assert moved.tensors[key].is_cuda and torch.equal(moved.tensors[key].cpu(), tensor), key
    on_device = next(iter(PackLoader(dataset, global_batch_size=1, num_workers=1, pin_memory=True, device="cuda")))
    assert all(tensor.is_cuda for tensor in on_device.tensors.values())


def test_pinned_batches_from_workers_shared_memory_equal_those_built_without_workers_while_held(tmp_path):
    from support.packing import build_groups, config_of

    from mmidx.index.pack_index import build_pack_index
    from mmidx.pack.builder import PackBuilder
    from mmidx.train.loader import PackDataset, PackLoader

    config = config_of(build_groups(tmp_path), dropout={"text": 0.3, "vit": 0.3, "vae": 0.3})
    dataset = PackDataset(build_pack_index(config, num_samples=120), PackBuilder(config))
    expected = list(PackLoader(dataset, global_batch_size=1))
    held = []  # every batch kept on the device while later ones are copied from the worker's reused segments
    for batch in PackLoader(dataset, global_batch_size=1, num_workers=2, pin_memory=True, device="cuda"):
        held.append(batch)
    torch.cuda.synchronize()
    assert len(held) == len(expected) >= 8
    for got, want in zip(held, expected, strict=True):
        assert sorted(got.tensors) == sorted(want.tensors)
        for key, tensor in want.tensors.items():
            if isinstance(tensor, torch.Tensor):
                assert got.tensors[key].is_cuda and torch.equal(got.tensors[key].cpu(), tensor), key


def test_device_decode_with_the_callers_stream_busy_equals_the_idle_decode_or_is_refused():
    datas = []
    for seed in range(8):  # PIL writes baseline 4:2:0 JPEGs: nvJPEG's hardware path decodes them where it has one
        image = Image.merge("RGB", [Image.effect_noise((512, 384), 20 + 10 * c + seed) for c in range(3)])
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=90)
        datas.append(np.frombuffer(buffer.getvalue(), dtype=np.uint8))
    if torch.cuda.get_device_name() in INEXACT_GPUS:  # measured inexact there: refused by default
        with pytest.raises(DeviceDecodeError, match="is refused"):
            decode_jpeg_batch(datas, "cuda")
        return
    reference = decode_jpeg_batch(datas, "cuda")
    torch.cuda.synchronize()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def stall():  # ~10 ms of matrix products on an H100, queued before each decode
        for _ in range(50):
            torch.mm(a, a, out=out)

    assert decode_exactness(datas, reference, "cuda", "busy", 50, stall) == \
        {"iterations": 50, "pixels differ": 0, "memory damaged": 0, "inexact": 0}
