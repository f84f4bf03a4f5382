"""The fused pixel kernel (csrc/_pixels.pyx) against the path it replaces: PIL's bicubic ``resize``
on the decoded RGB image, then torchvision's ``ToTensor`` + ``Normalize`` as transcribed step by step in float32
(``transcribed_to_tensor_normalize``: a transcription of torchvision's documented steps, not torchvision), then
BAGEL's ``patchify``; the JPEG decoder against PIL's;
and the pool of batch buffers the kernel writes into. Every comparison is bit for bit.
"""

from __future__ import annotations

import io
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from support.images import encode, noise, palette_image, transcribed_to_tensor_normalize
from support.packing import GEOMETRY, build_groups

import mmidx.images.transform
from mmidx import _pixels
from mmidx.config import DataConfig
from mmidx.images.decode import ImageError, decode_rgb, decode_rgb_pixels, rgb_pixels
from mmidx.images.patches import patchify
from mmidx.images.transform import BAGEL_VAE_TRANSFORM, BAGEL_VIT_TRANSFORM, ImageTransform
from mmidx.index.pack_index import PackItem
from mmidx.pack.buffers import _batch_buffer, _BufferPool
from mmidx.pack.builder import PackBuilder

IMAGENET = ImageTransform(518, 224, 14, image_mean=(0.485, 0.456, 0.406), image_std=(0.229, 0.224, 0.225))
TRANSFORMS = [BAGEL_VAE_TRANSFORM, IMAGENET]


def pil_reference(image: Image.Image, width: int, height: int, transform: ImageTransform) -> torch.Tensor:
    """BAGEL's path: PIL bicubic resize (skipped at the same size, as torchvision does), then the transcribed
    ToTensor, Normalize."""
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return transcribed_to_tensor_normalize(image, transform.image_mean, transform.image_std)


def kernel_chw(pixels: np.ndarray, width: int, height: int, transform: ImageTransform) -> torch.Tensor:
    """The kernel writing into a slot of a larger padded buffer (rows contiguous, planes not)."""
    padded = torch.full((2, 3, height + 3, width + 5), 7.0)
    transform.normalize_into(pixels, padded[1, :, :height, :width])
    assert torch.all(padded[1, :, height:] == 7) and torch.all(padded[1, :, :height, width:] == 7)
    assert torch.all(padded[0] == 7)
    return padded[1, :, :height, :width]


def random_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Noise, or a smooth ramp with noise (bicubic overshoot and clipping show on both)."""
    if rng.random() < 0.5:
        return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    y, x = np.mgrid[0:height, 0:width]
    ramp = (x * 255 // max(width - 1, 1) + y * 3)[..., None] + rng.integers(-20, 21, (height, width, 3))
    return Image.fromarray(np.clip(ramp, 0, 255).astype(np.uint8))


@pytest.mark.usefixtures("resize_kernel")
def test_random_small_sizes_up_and_down_equal_pil_and_the_transcribed_torchvision_steps():
    rng = np.random.default_rng(13)
    for case in range(600):
        width, height, new_width, new_height = (int(v) for v in rng.integers(1, 48, 4))
        if case % 5 == 0:
            new_width = width                      # vertical pass only
        elif case % 5 == 1:
            new_height = height                    # horizontal pass only
        image = random_image(rng, width, height)
        transform = TRANSFORMS[case % 2]
        pixels = rgb_pixels(image) if case % 3 else np.asarray(image)   # 4- and 3-byte pixels
        expected = pil_reference(image, new_width, new_height, transform)
        assert torch.equal(kernel_chw(pixels, new_width, new_height, transform), expected), \
            (width, height, new_width, new_height)


@pytest.mark.usefixtures("resize_kernel")
@pytest.mark.parametrize(("size", "new_size"), [
    ((4000, 3), (518, 14)), ((3, 4000), (16, 1024)), ((1, 1), (64, 32)), ((2000, 1), (7, 3)),
    ((1, 3000), (5, 1000)), ((3000, 2000), (1024, 683)), ((2, 700), (900, 14)), ((640, 480), (4000, 7)),
])
def test_large_sizes_and_extreme_aspect_ratios_equal_pil(size, new_size):
    image = random_image(np.random.default_rng(sum(size)), *size)
    expected = pil_reference(image, *new_size, BAGEL_VAE_TRANSFORM)
    assert torch.equal(kernel_chw(rgb_pixels(image), *new_size, BAGEL_VAE_TRANSFORM), expected)


@pytest.mark.usefixtures("resize_kernel")
@pytest.mark.parametrize("patch", [14, 16, 3])
def test_patches_equal_patchify_of_the_reference(patch):
    rng = np.random.default_rng(patch)
    for _ in range(60):
        width, height = (int(v) for v in rng.integers(1, 90, 2))
        columns, rows = (int(v) for v in rng.integers(1, 6, 2))
        new_width, new_height = columns * patch, rows * patch
        image = random_image(rng, width, height)
        out = torch.empty(rows * columns, patch * patch * 3)
        IMAGENET.patches_into(rgb_pixels(image), out, patch, new_height, new_width)
        assert torch.equal(out, patchify(pil_reference(image, new_width, new_height, IMAGENET), patch))


@pytest.mark.usefixtures("resize_kernel")
@pytest.mark.parametrize("patch", [14, 2, 5])
@pytest.mark.parametrize(("size", "new_size"), [
    ((70, 42), (70, 42)), ((50, 42), (70, 42)), ((70, 30), (70, 42)), ((64, 40), (42, 28)), ((48, 300), (84, 28)),
], ids=["no-resize", "horizontal", "vertical", "both", "vertical-first"])
def test_patches_from_every_pass_and_pixel_layout_equal_patchify_of_the_reference_in_their_rows_only(
        size, new_size, patch):
    """Each pass combination of the resize (vertical-first: Pillow 13's order when the height shrinks most), from
    3- and 4-byte pixels, each row of patches written whole into the rows of a larger buffer and nothing beside;
    patch 2's 6-value runs are looked up, the others computed with AVX2 where the kernel is avx2."""
    width, height = new_size[0] // patch * patch, new_size[1] // patch * patch
    image = random_image(np.random.default_rng(width * height + patch), *size)
    expected = patchify(pil_reference(image, width, height, IMAGENET), patch)
    for pixels in (np.asarray(image), rgb_pixels(image)):
        buffer = torch.full((len(expected) + 2, patch * patch * 3), 7.0)
        IMAGENET.patches_into(pixels, buffer[1:-1], patch, height, width)
        assert torch.equal(buffer[1:-1], expected), pixels.strides
        assert torch.all(buffer[0] == 7) and torch.all(buffer[-1] == 7)


@pytest.mark.usefixtures("resize_kernel")
@pytest.mark.parametrize(("image", "fmt", "options"), [
    (noise("RGB", 301, 97), "JPEG", {}), (noise("L", 97, 301), "JPEG", {}), (noise("CMYK", 130, 130), "JPEG", {}),
    (noise("RGBA", 150, 40), "PNG", {}), (noise("LA", 40, 150), "PNG", {}), (noise("L", 66, 70), "PNG", {}),
    (palette_image(90, 60, None), "PNG", {}), (palette_image(60, 90, 3), "PNG", {}),
    (palette_image(77, 55, 3), "GIF", {"transparency": 3}), (noise("RGB", 50, 50), "WEBP", {}),
    (Image.new("I;16", (80, 30), 40000), "PNG", {}),
], ids=["jpeg-rgb", "jpeg-l", "jpeg-cmyk", "png-rgba", "png-la", "png-l", "png-p", "png-p-trns", "gif-trns",
        "webp", "png-i16"])
@pytest.mark.parametrize("transform", [BAGEL_VAE_TRANSFORM, BAGEL_VIT_TRANSFORM], ids=["vae", "vit"])
def test_every_mode_bagel_converts_equals_pil(image, fmt, options, transform):
    rgb = decode_rgb(encode(image, fmt, **options))
    width, height = transform.output_size(rgb, img_num=3)
    assert torch.equal(transform(rgb, img_num=3), pil_reference(rgb, width, height, transform))


@pytest.mark.usefixtures("resize_kernel")
def test_before_pillow_13_the_horizontal_pass_always_runs_first(monkeypatch):
    """Older Pillows resize horizontally then vertically; each single-direction resize is the same in every
    version, so composing two of them is the reference for the order the kernel follows there."""
    monkeypatch.setattr(mmidx.images.transform, "_PILLOW_VERTICAL_FIRST", False)
    rng = np.random.default_rng(12)
    for _ in range(200):
        width, height, new_width, new_height = (int(v) for v in rng.integers(1, 60, 4))
        image = random_image(rng, width, height)
        horizontal_then_vertical = image.resize((new_width, height), Image.Resampling.BICUBIC)
        expected = pil_reference(horizontal_then_vertical, new_width, new_height, BAGEL_VAE_TRANSFORM)
        assert torch.equal(kernel_chw(rgb_pixels(image), new_width, new_height, BAGEL_VAE_TRANSFORM), expected)


@pytest.mark.usefixtures("resize_kernel")
@pytest.mark.parametrize("new_size", [(37, 23), (23, 37), (64, 96)])
def test_pixels_neither_3_nor_4_bytes_apart_are_resized_as_a_contiguous_copy(new_size):
    image = random_image(np.random.default_rng(3), 70, 50)
    columns_first = np.ascontiguousarray(np.asarray(image).transpose(1, 0, 2)).transpose(1, 0, 2)
    assert columns_first.strides[1] == 150
    expected = pil_reference(image, *new_size, BAGEL_VAE_TRANSFORM)
    assert torch.equal(kernel_chw(columns_first, *new_size, BAGEL_VAE_TRANSFORM), expected)


def cpu_info(field: str) -> str | None:
    """A field of the first processor in /proc/cpuinfo (None off Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":")[0].strip() == field), None)


def test_the_fastest_kernel_for_the_cpu_is_chosen_and_others_can_be_forced():
    """AVX2 CPUs take the pmulld kernel on AMD from Zen 3 (family 0x19 = 25) on, the split-weight one elsewhere."""
    available = _pixels.available_kernels()
    assert available[0] == "scalar" and set(available) <= {"scalar", "sse4", "avx2", "avx2-madd"}
    previous = _pixels.kernel()
    try:
        for name in available:
            _pixels.set_kernel(name)
            assert _pixels.kernel() == name
        with pytest.raises(ValueError, match="no resize kernel 'avx512' on this CPU; available: scalar"):
            _pixels.set_kernel("avx512")
    finally:
        _pixels.set_kernel(previous)
    vendor, family = cpu_info("vendor_id"), cpu_info("cpu family")
    if "avx2" in available and vendor is not None and family is not None:
        assert previous == ("avx2" if vendor == "AuthenticAMD" and int(family) >= 0x19 else "avx2-madd")
    else:
        assert previous == available[-1] or previous in ("avx2", "avx2-madd")


CLIP = ImageTransform(518, 224, 14, image_mean=(0.48145466, 0.4578275, 0.40821073),
                      image_std=(0.26862954, 0.26130258, 0.27577711))


def looked_up(pixels: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The straightforward reference of an unresized image: each channel's level looked up, as (3, H, W)."""
    return np.stack([table[c][pixels[:, :, c]] for c in range(3)])


@pytest.mark.usefixtures("resize_kernel")
@pytest.mark.parametrize("transform", [BAGEL_VAE_TRANSFORM, IMAGENET, CLIP], ids=["bagel", "imagenet", "clip"])
def test_unresized_rows_of_every_width_are_the_table_looked_up_bit_for_bit(transform):
    """Widths around the vector widths (8 and 16 pixels) and their tails, 3- and 4-byte pixels."""
    rng = np.random.default_rng(5)
    for width in [*range(1, 40), 64, 95, 512]:
        image = Image.fromarray(rng.integers(0, 256, (3, width, 3), dtype=np.uint8))
        for pixels in (np.asarray(image), rgb_pixels(image)):
            out = kernel_chw(pixels, width, 3, transform).numpy()
            assert out.tobytes() == looked_up(np.asarray(image), transform.lookup_table).tobytes(), width


@pytest.mark.parametrize("name", ["avx2", "avx2-madd"])
def test_the_avx2_kernels_compute_the_levels_of_the_usual_normalisations_and_only_where_they_match(name):
    if name not in _pixels.available_kernels():
        pytest.skip(f"this CPU does not run the {name} kernel, one with a normalise step")
    previous = _pixels.kernel()
    try:
        _pixels.set_kernel(name)
        for transform in (BAGEL_VAE_TRANSFORM, BAGEL_VIT_TRANSFORM, IMAGENET, CLIP):
            assert _pixels.computes_levels(transform.lookup_table, transform.normalization)
        table = BAGEL_VAE_TRANSFORM.lookup_table.copy()
        table[1, 200] = np.nextafter(table[1, 200], np.float32(2))      # one level one ulp off
        assert not _pixels.computes_levels(table, BAGEL_VAE_TRANSFORM.normalization)
        unit = ImageTransform(512, 256, 16, image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0))
        assert _pixels.computes_levels(unit.lookup_table, unit.normalization)
        negative_zero = unit.lookup_table.copy()
        assert negative_zero[2, 0] == 0 and not np.signbit(negative_zero[2, 0])
        negative_zero[2, 0] = -0.0                                       # == 0.0, but not bit for bit
        assert not _pixels.computes_levels(negative_zero, unit.normalization)
        # a table the normalisation does not reproduce is looked up, in both layouts
        rng = np.random.default_rng(8)
        pixels = rng.integers(0, 256, (28, 40, 3), dtype=np.uint8)
        pixels[0, :, 1] = 200
        out = np.zeros((3, 28, 40), np.float32)
        _pixels.render_chw(pixels, out, table, False, BAGEL_VAE_TRANSFORM.normalization)
        assert out.tobytes() == looked_up(pixels, table).tobytes()
        patches = np.zeros((4, 588), np.float32)
        _pixels.render_patches(pixels[:, :28], patches, table, 28, 28, 14, False, BAGEL_VAE_TRANSFORM.normalization)
        expected = torch.from_numpy(looked_up(np.ascontiguousarray(pixels[:, :28]), table))
        assert torch.equal(torch.from_numpy(patches), patchify(expected, 14))
        _pixels.set_kernel("sse4")
        assert not _pixels.computes_levels(BAGEL_VAE_TRANSFORM.lookup_table, BAGEL_VAE_TRANSFORM.normalization)
    finally:
        _pixels.set_kernel(previous)


def test_kernel_refuses_mismatched_shapes():
    pixels = np.zeros((20, 30, 3), np.uint8)
    table = BAGEL_VAE_TRANSFORM.lookup_table
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        _pixels.render_chw(np.zeros((20, 30, 4), np.uint8), np.zeros((3, 5, 5), np.float32), table, False)
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        _pixels.render_chw(np.zeros((0, 30, 3), np.uint8), np.zeros((3, 5, 5), np.float32), table, False)
    with pytest.raises(ValueError, match=r"\(3, h, w\)"):
        _pixels.render_chw(pixels, np.zeros((3, 0, 5), np.float32), table, False)
    with pytest.raises(ValueError, match=r"\(3, h, w\)"):
        _pixels.render_chw(pixels, np.zeros((3, 5, 5), np.float32)[:, :, ::2], table, False)
    with pytest.raises(ValueError, match="table"):
        _pixels.render_chw(pixels, np.zeros((3, 5, 5), np.float32), np.zeros((3, 255), np.float32), False)
    with pytest.raises(ValueError, match="normalization must be"):
        _pixels.render_chw(pixels, np.zeros((3, 5, 5), np.float32), table, False, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="does not divide"):
        _pixels.render_patches(pixels, np.zeros((4, 588), np.float32), table, 28, 29, 14, False)
    with pytest.raises(ValueError, match=r"out must be \(4, 588\)"):
        _pixels.render_patches(pixels, np.zeros((5, 588), np.float32), table, 28, 28, 14, False)


def jpeg(image: Image.Image, **options) -> bytes:
    return encode(image, "JPEG", **options)


def test_jpegs_decode_to_exactly_pils_pixels(monkeypatch):
    monkeypatch.setattr(ImageFile, "MAXBLOCK", 1 << 24)  # PIL's default buffer is too small for progressive noise
    rng = np.random.default_rng(5)
    datas = [jpeg(random_image(rng, width, height), quality=int(rng.integers(40, 99)), subsampling=subsampling,
                  progressive=progressive, optimize=bool(rng.integers(0, 2)) and width * height > 100)
             for width, height in [(512, 512), (1, 1), (7, 3), (333, 517), (1023, 767), (17, 900)]
             for subsampling in (0, 1, 2) for progressive in (False, True)]
    datas.append(jpeg(random_image(rng, 300, 200).convert("L")))
    for data in datas:
        assert np.array_equal(decode_rgb_pixels(data), np.asarray(decode_rgb(data)))


@pytest.mark.parametrize(("image", "fmt"), [(noise("CMYK", 40, 30), "JPEG"), (noise("RGBA", 40, 30), "PNG"),
                                            (palette_image(40, 30, 3), "GIF")], ids=["jpeg-cmyk", "png", "gif"])
def test_other_images_decode_through_pil(image, fmt):
    data = encode(image, fmt)
    assert np.array_equal(decode_rgb_pixels(data), np.asarray(decode_rgb(data)))


def test_bad_jpegs_are_image_errors():
    data = jpeg(noise("RGB", 64, 64))
    for cut in (20, len(data) // 2, len(data) - 10):
        with pytest.raises(ImageError):
            decode_rgb_pixels(data[:cut])
    with pytest.raises(ImageError, match="decompression bomb"):
        decode_rgb_pixels(data, max_pixels=64 * 63)


# --------------------------------------------------------------------------- batch buffers


def test_batch_buffers_are_reused_only_once_nothing_uses_them():
    first = _batch_buffer(2, 3, 256, 256)
    address = first.data_ptr()
    assert _batch_buffer(2, 3, 256, 256).data_ptr() != address      # in use: another buffer
    view = first[1, 2]
    del first
    assert _batch_buffer(1, 3, 256, 256).data_ptr() != address      # a view still uses it
    array = view.numpy()
    del view
    assert _batch_buffer(1, 3, 256, 256).data_ptr() != address      # an array derived from it still does
    del array
    assert _batch_buffer(1, 3, 256, 256).data_ptr() == address      # free: reused


def test_the_pool_reuses_a_free_buffer_of_exactly_the_size_asked_and_keeps_at_most_its_size():
    pool = _BufferPool(size=2)
    first = pool.buffer(100)
    address = first.ctypes.data
    del first
    assert pool.buffer(100).ctypes.data == address  # free and exactly large enough: reused
    held = [pool.buffer(50) for _ in range(3)]  # the free one, a new pooled one, then all in use: unpooled
    assert len({array.ctypes.data for array in held}) == 3 and held[0].ctypes.data == address
    assert len(pool.buffers) == 2


def test_a_batch_key_moved_to_shared_memory_keeps_its_values_and_frees_its_buffer():
    tensor = _batch_buffer(2, 3, 256, 256).fill_(3.0)
    address = tensor.data_ptr()
    ForkingPickler(io.BytesIO()).dump(tensor)                         # what a DataLoader worker does
    assert tensor.data_ptr() != address
    assert _batch_buffer(2, 3, 256, 256).fill_(5.0).data_ptr() == address
    assert torch.all(tensor == 3.0)


def test_batches_kept_alive_are_never_overwritten_by_later_ones(tmp_path):
    groups = build_groups(tmp_path)
    config = DataConfig.from_dict({"groups": groups, "geometry": GEOMETRY, "seed": 5,
                                   "dropout": {"text": 0.0, "vit": 0.0, "vae": 0.0},
                                   "packing": {"max_num_tokens": 8192, "expected_num_tokens": 4096,
                                               "max_num_tokens_per_sample": 4096}})
    packs = [[PackItem(group, 0, sample, 0) for group in (0, 1, 2)] for sample in range(3)] * 2
    keys = ("padded_images", "packed_vit_tokens")
    builder = PackBuilder(config)
    expected = []
    for k, items in enumerate(packs):                  # one batch alive at a time, its pixels copied out
        batch = builder.build(k, items).to_dict()
        expected.append({key: batch[key].clone() for key in keys})
    kept = [builder.build(k, items).to_dict() for k, items in enumerate(packs)]   # all alive: more than the pool
    for k in range(len(packs)):
        for key in keys:
            assert torch.equal(kept[k][key], expected[k][key]), (k, key)
