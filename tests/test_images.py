"""mmidx.images: probing, BAGEL's RGB conversion, resize rule, tensors, patches and position ids.

References in this file are written from BAGEL_SEMANTICS.md's prose and a transcription of torchvision's
documented ToTensor/Normalize steps (``transcribed_to_tensor_normalize``: torchvision itself is not importable beside
the CPU torch here), independently of mmidx's code.
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile
from support.images import (
    encode,
    junk_before_the_end_marker,
    noise,
    palette_image,
    transcribed_to_tensor_normalize,
)

from mmidx.format import IMAGE_DTYPE, IMAGE_FORMATS, IMAGE_MODES
from mmidx.images.decode import (
    ImageError,
    ImageInfo,
    check_decodes,
    decode_rgb,
    decode_rgb_pixels,
    downsize_and_reencode,
    open_image,
    probe,
    rgb_pixels,
    to_rgb,
    verify_decodable,
)
from mmidx.images.device import decode_jpeg_batch
from mmidx.images.patches import patchify, position_ids_extrapolate, position_ids_interpolate
from mmidx.images.transform import (
    BAGEL_MAX_PIXELS,
    BAGEL_VAE_TRANSFORM,
    BAGEL_VIT_TRANSFORM,
    BAGEL_VLM_TRANSFORM,
    ImageTransform,
    num_image_tokens,
    resize_shape,
    resize_shapes,
)

PRESETS = {"vae": BAGEL_VAE_TRANSFORM, "vit": BAGEL_VIT_TRANSFORM, "vlm": BAGEL_VLM_TRANSFORM}


# --------------------------------------------------------------------------- helpers


def png_header(width: int, height: int) -> bytes:
    """A PNG that is only a signature, an IHDR claiming width×height RGB, and IEND: no pixels at all."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def reference_resize(width, height, *, max_size, min_size, stride, max_pixels, img_num=1):
    """BAGEL_SEMANTICS.md "Images", in plain Python: scale, round each side (Python round), round to a
    multiple of stride (at least stride); pixel budget ratio applied linearly; long edge clamped."""
    def rescale(w, h, scale):
        w, h = round(w * scale), round(h * scale)
        return max(stride, round(w / stride) * stride), max(stride, round(h / stride) * stride)

    w, h = rescale(width, height, max(min(max_size / max(width, height), 1.0), min_size / min(width, height)))
    if w * h > max_pixels / img_num:
        w, h = rescale(w, h, max_pixels / img_num / (w * h))
    if max(w, h) > max_size:
        w, h = rescale(w, h, max_size / max(w, h))
    return w, h


def preset_kwargs(transform: ImageTransform) -> dict[str, int]:
    return {"max_size": transform.max_image_size, "min_size": transform.min_image_size,
            "stride": transform.image_stride, "max_pixels": transform.max_pixels}


# --------------------------------------------------------------------------- probe


@pytest.mark.parametrize(
    ("image", "fmt", "options", "expected"),
    [
        (noise("RGB", 37, 23), "JPEG", {}, ("JPEG", "RGB", False)),
        (noise("L", 37, 23), "JPEG", {}, ("JPEG", "L", False)),
        (noise("CMYK", 37, 23), "JPEG", {}, ("JPEG", "CMYK", False)),
        (noise("RGBA", 37, 23), "PNG", {}, ("PNG", "RGBA", True)),
        (noise("LA", 37, 23), "PNG", {}, ("PNG", "LA", True)),
        (noise("L", 37, 23), "PNG", {}, ("PNG", "L", False)),
        (palette_image(37, 23, None), "PNG", {}, ("PNG", "P", False)),
        (palette_image(37, 23, 3), "PNG", {}, ("PNG", "P", True)),
        (Image.new("I;16", (37, 23), 40000), "PNG", {}, ("PNG", "I;16", False)),
        (noise("RGB", 37, 23), "WEBP", {}, ("WEBP", "RGB", False)),
        (noise("RGBA", 37, 23), "WEBP", {}, ("WEBP", "RGBA", True)),
        (palette_image(37, 23, None), "GIF", {}, ("GIF", "P", False)),
        (palette_image(37, 23, 3), "GIF", {"transparency": 3}, ("GIF", "P", True)),
        (noise("RGB", 37, 23), "BMP", {}, ("BMP", "RGB", False)),
        (noise("RGB", 37, 23), "TIFF", {}, ("TIFF", "RGB", False)),
    ],
    ids=["jpeg-rgb", "jpeg-l", "jpeg-cmyk", "png-rgba", "png-la", "png-l", "png-p", "png-p-trns", "png-i16",
         "webp-rgb", "webp-rgba", "gif", "gif-trns", "bmp", "tiff"],
)
def test_probe_reports_size_format_mode_and_transparency(image, fmt, options, expected):
    assert probe(encode(image, fmt, **options)) == ImageInfo(37, 23, *expected)


def test_probe_reads_the_header_only(monkeypatch):
    data = encode(noise("RGB", 64, 48), "JPEG")

    def no_decoding(self):
        raise AssertionError("probe decoded pixels")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    assert probe(memoryview(data)).width == 64


def test_probe_names_formats_outside_the_table_unknown():
    assert probe(encode(noise("RGB", 5, 4), "PPM")).format == "unknown"


@pytest.mark.parametrize("data", [b"", b"not an image at all", np.random.default_rng(1).bytes(4096),
                                  b"\x89PNG\r\n\x1a\n" + np.random.default_rng(2).bytes(100)],
                         ids=["empty", "text", "random", "png-signature-then-garbage"])
def test_unrecognised_data_raises_image_error(data):
    with pytest.raises(ImageError, match="not a readable image"):
        probe(data)


def test_image_error_is_a_value_error():
    assert issubclass(ImageError, ValueError)


def test_decompression_bomb_header_is_refused_without_decoding():
    with pytest.raises(ImageError, match="decompression bomb"):
        probe(png_header(100_000, 100_000))


def test_max_pixels_is_the_limit():
    data = encode(noise("RGB", 20, 20), "PNG")
    assert probe(data, max_pixels=400).width == 20
    with pytest.raises(ImageError, match="exceeds max_pixels=399"):
        probe(data, max_pixels=399)


def test_images_between_pil_warning_and_max_pixels_probe_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe(png_header(11_000, 11_000)).width == 11_000  # over PIL's 89M-pixel warning


def test_max_pixels_above_pils_own_limit_is_a_configuration_error():
    with pytest.raises(ValueError, match=r"PIL\.Image\.MAX_IMAGE_PIXELS"):
        probe(png_header(10, 10), max_pixels=2**31)


def test_info_round_trips_through_an_image_record():
    info = ImageInfo(640, 480, "PNG", "LA", True)
    record = info.record()
    assert record.dtype == IMAGE_DTYPE
    assert (record["format"], record["mode"], record["flags"]) == (IMAGE_FORMATS.index("PNG"),
                                                                   IMAGE_MODES.index("LA"), 1)
    assert ImageInfo.from_record(record) == info


# --------------------------------------------------------------------------- decode and verify


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_images_are_rejected(fmt):
    data = encode(noise("RGB", 256, 256), fmt)
    truncated = data[: len(data) // 2]
    assert probe(truncated).width == 256  # the header is intact
    with pytest.raises(ImageError, match="cannot decode"):
        verify_decodable(truncated)
    with pytest.raises(ImageError, match="cannot decode"):
        decode_rgb(truncated)


def test_verify_decodable_returns_the_probed_info():
    assert verify_decodable(encode(noise("RGBA", 30, 20), "WEBP")) == ImageInfo(30, 20, "WEBP", "RGBA", True)


def test_verify_decodable_refuses_a_jpeg_the_loader_refuses_though_pil_decodes_it():
    data = junk_before_the_end_marker(encode(noise("RGB", 64, 48), "JPEG"))
    assert decode_rgb(data).size == (64, 48)  # PIL's decoder passes it
    with pytest.raises(ImageError, match="extraneous bytes before marker 0xd9"):
        decode_rgb_pixels(data)  # the loader's strict decode refuses it: every pack holding it would fail
    with pytest.raises(ImageError, match="extraneous bytes before marker 0xd9"):
        verify_decodable(data)


JPEG_BASES = [encode(noise(mode, 40 + 8 * k, 24 + 8 * k, seed=k), "JPEG", **options)
              for k, (mode, options) in enumerate([("RGB", {}), ("RGB", {"progressive": True}),
                                                   ("RGB", {"subsampling": 0}), ("L", {}),
                                                   ("L", {"progressive": True})])]


def _passes(check, *args) -> bool:
    try:
        check(*args)
    except ImageError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(JPEG_BASES), st.sampled_from(["flip", "insert", "truncate"]),
       st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=3))
def test_the_builds_check_refuses_exactly_the_jpegs_the_loaders_decode_refuses(base, kind, edits):
    data = bytearray(base)
    for where, value in edits:
        offset = int(where * len(data))
        if kind == "flip":
            data[offset] ^= value
        elif kind == "insert":  # junk bytes anywhere (before the end marker, inside a scan, in a header)
            data[offset:offset] = bytes([value]) * (1 + value % 8)
        else:
            del data[max(offset, 1):]
    data = bytes(data)
    try:
        image, info = open_image(data)
    except ImageError:
        return  # the header does not parse: both refuse it before any check
    assert _passes(check_decodes, image, data, info) == _passes(decode_rgb_pixels, data)


def test_verify_refuses_to_run_while_pil_pads_truncated_images(monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        verify_decodable(encode(noise("RGB", 8, 8), "PNG"))


# --------------------------------------------------------------------------- to_rgb (BAGEL's pil_img2rgb)


def test_rgba_is_composited_on_white():
    image = Image.fromarray(np.array([[(10, 20, 30, 0), (10, 20, 30, 255), (0, 0, 0, 128)]], np.uint8))
    assert np.asarray(to_rgb(image)).tolist() == [[[255, 255, 255], [10, 20, 30], [127, 127, 127]]]


def test_palette_transparency_becomes_white():
    image = palette_image(8, 8, transparency=None)
    transparent_index = image.getpixel((0, 0))
    image.info["transparency"] = transparent_index
    rgb = np.asarray(to_rgb(Image.open(io.BytesIO(encode(image, "PNG")))))
    mask = np.asarray(image) == transparent_index
    assert (rgb[mask] == 255).all()
    assert (rgb[~mask] == np.asarray(image.convert("RGB"))[~mask]).all()


def test_colour_key_transparency_of_rgb_png_becomes_white():
    image = Image.fromarray(np.array([[(1, 2, 3), (4, 5, 6)]], np.uint8))
    decoded = decode_rgb(encode(image, "PNG", transparency=(1, 2, 3)))
    assert np.asarray(decoded).tolist() == [[[255, 255, 255], [4, 5, 6]]]


def test_la_alpha_is_dropped_not_composited_as_in_bagel():
    image = Image.new("LA", (1, 1), (0, 0))  # black, fully transparent
    assert decode_rgb(encode(image, "PNG")).getpixel((0, 0)) == (0, 0, 0)


@pytest.mark.parametrize(("image", "fmt"), [
    (noise("CMYK", 9, 7), "JPEG"), (noise("L", 9, 7), "PNG"), (palette_image(9, 7, None), "PNG"),
    (Image.new("I;16", (9, 7), 200), "PNG"), (noise("RGB", 9, 7), "JPEG"),
], ids=["cmyk", "l", "p", "i16", "rgb"])
def test_images_without_alpha_are_converted_by_pil(image, fmt):
    data = encode(image, fmt)
    expected = Image.open(io.BytesIO(data)).convert("RGB")
    assert np.array_equal(np.asarray(decode_rgb(data)), np.asarray(expected))


# --------------------------------------------------------------------------- BAGEL's resize rule

# Sides that land on .5 after scaling or after dividing by the stride: k·stride + stride/2 at scale 1,
# odd sides next to 2·max_size (scale 0.5), and 2·max_size itself.
TIE_SIDES = sorted({s * k + s // 2 for s in (14, 16) for k in range(1, 80)}
                   | {2 * m + d for m in (518, 980, 1024) for d in (-3, -1, 0, 1, 3)}
                   | {1025, 1037, 1039, 1961})
sides = st.one_of(st.integers(1, 64), st.integers(1, 4096), st.integers(1, 1 << 24),
                  st.sampled_from(TIE_SIDES))


@pytest.mark.parametrize("preset", PRESETS)
@settings(max_examples=300, deadline=None)
@given(width=sides, height=sides, img_num=st.integers(1, 16))
def test_resize_shape_follows_bagels_rule(preset, width, height, img_num):
    kwargs = preset_kwargs(PRESETS[preset])
    assert resize_shape(width, height, img_num=img_num, **kwargs) == \
        reference_resize(width, height, img_num=img_num, **kwargs)


@pytest.mark.parametrize("preset", PRESETS)
@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(sides, sides, st.integers(1, 16)), min_size=1, max_size=200))
def test_resize_shapes_vectorised_equals_the_rule_per_image(preset, sizes):
    kwargs = preset_kwargs(PRESETS[preset])
    widths, heights, img_nums = (np.array(column) for column in zip(*sizes, strict=True))
    new_widths, new_heights = resize_shapes(widths, heights, img_nums=img_nums, **kwargs)
    expected = [reference_resize(w, h, img_num=k, **kwargs) for w, h, k in sizes]
    assert list(zip(new_widths.tolist(), new_heights.tolist(), strict=True)) == expected


@settings(max_examples=200, deadline=None)
@given(width=sides, height=sides, max_size=st.integers(16, 4096), min_size=st.integers(1, 2048),
       stride=st.integers(1, 64), max_pixels=st.integers(1, 1 << 26), img_num=st.integers(1, 16))
def test_resize_shape_follows_bagels_rule_for_any_configuration(width, height, max_size, min_size, stride,
                                                                max_pixels, img_num):
    kwargs = {"max_size": max_size, "min_size": min_size, "stride": stride, "max_pixels": max_pixels}
    assert resize_shape(width, height, img_num=img_num, **kwargs) == \
        reference_resize(width, height, img_num=img_num, **kwargs)


@st.composite
def exact_half_scales(draw):
    """(preset, width, height) whose long edge is max_size·2^e, so the scale is exactly 2^-e and the
    short side often lands on a .5 (or .25/.75) after scaling."""
    preset = draw(st.sampled_from(sorted(PRESETS)))
    transform = PRESETS[preset]
    long_edge = transform.max_image_size * 2 ** draw(st.integers(1, 3))
    short = draw(st.integers(transform.min_image_size * long_edge // transform.max_image_size, long_edge))
    return (preset, long_edge, short) if draw(st.booleans()) else (preset, short, long_edge)


@settings(max_examples=300, deadline=None)
@given(case=exact_half_scales())
def test_resize_shape_rounds_exact_halves_like_bagel(case):
    preset, width, height = case
    kwargs = preset_kwargs(PRESETS[preset])
    assert resize_shape(width, height, **kwargs) == reference_resize(width, height, **kwargs)


def test_worked_examples_of_bagel_semantics():
    assert BAGEL_VAE_TRANSFORM.output_shapes(512, 512) == (512, 512)
    assert num_image_tokens(512, 512, BAGEL_VAE_TRANSFORM) == 1024
    assert BAGEL_VIT_TRANSFORM.output_shapes(512, 512) == (518, 518)
    assert num_image_tokens(512, 512, BAGEL_VIT_TRANSFORM) == 1369


def test_sides_round_half_to_even_like_pythons_round():
    kwargs = preset_kwargs(BAGEL_VAE_TRANSFORM)
    assert resize_shape(520, 520, **kwargs) == (512, 512)  # 520 / 16 = 32.5 → 32
    assert resize_shape(536, 536, **kwargs) == (544, 544)  # 536 / 16 = 33.5 → 34
    assert resize_shape(2048, 1025, **kwargs) == (1024, 512)  # 1025 · 0.5 = 512.5 → 512
    assert resize_shape(2048, 1041, **kwargs) == (1024, 512)  # 520.5 → 520, then 520 / 16 = 32.5 → 32


def test_pixel_budget_shrinks_each_side_by_the_whole_ratio():
    # 980² under vlm with 12 images: budget 167,253 px, ratio 0.174 per side → 168², not ~409².
    assert resize_shape(980, 980, img_num=12, **preset_kwargs(BAGEL_VLM_TRANSFORM)) == (168, 168)


def test_sizes_outside_the_exact_domain_are_refused():
    kwargs = preset_kwargs(BAGEL_VAE_TRANSFORM)
    with pytest.raises(ValueError, match="image sizes"):
        resize_shape(0, 10, **kwargs)
    with pytest.raises(ValueError, match="img_num"):
        resize_shape(10, 10, img_num=0, **kwargs)
    with pytest.raises(ValueError, match="2\\*\\*53"):
        resize_shape(1, 2**31 - 1, max_size=2**40, min_size=2**23, stride=1, max_pixels=2**62)


def test_num_image_tokens_counts_patches_of_the_resized_image():
    widths, heights = np.array([512, 1920, 300, 4000, 33]), np.array([512, 1080, 2000, 100, 33])
    img_nums = np.array([1, 1, 3, 12, 1])
    counts = num_image_tokens(widths, heights, BAGEL_VLM_TRANSFORM, img_nums=img_nums)
    kwargs = preset_kwargs(BAGEL_VLM_TRANSFORM)
    shapes = [reference_resize(w, h, img_num=k, **kwargs)
              for w, h, k in zip(widths.tolist(), heights.tolist(), img_nums.tolist(), strict=True)]
    expected = [(h // 14) * (w // 14) for w, h in shapes]
    assert counts.tolist() == expected
    assert num_image_tokens(1024, 1024, BAGEL_VAE_TRANSFORM, patch_size=8) == 128 * 128


# --------------------------------------------------------------------------- ImageTransform


def test_transform_is_built_from_bagel_config_args():
    vlm = {"image_stride": 14, "max_image_size": 980, "min_image_size": 378, "max_pixels": 2_007_040}
    assert ImageTransform.from_args(vlm) == BAGEL_VLM_TRANSFORM
    assert ImageTransform.from_args({"image_stride": 16, "max_image_size": 1024, "min_image_size": 512,
                                     "image_mean": [0.5, 0.5, 0.5]}) == BAGEL_VAE_TRANSFORM
    assert BAGEL_VAE_TRANSFORM.max_pixels == BAGEL_MAX_PIXELS == 14 * 14 * 9 * 1024
    with pytest.raises(ValueError, match="unknown image transform arguments \\['stride'\\]"):
        ImageTransform.from_args({"stride": 16, "max_image_size": 1024, "min_image_size": 512})


@pytest.mark.parametrize(("mean", "std"), [((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
                                           ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
def test_every_level_maps_to_its_float32_normalisation(mean, std):
    levels = np.repeat(np.arange(256, dtype=np.uint8)[:, None, None], 3, axis=2)  # a 256×1 grey ramp
    output = ImageTransform(518, 224, 14, image_mean=mean, image_std=std).to_tensor(Image.fromarray(levels))
    level = np.arange(256, dtype=np.float32)[:, None]
    for channel in range(3):
        expected = (level / np.float32(255) - np.float32(mean[channel])) / np.float32(std[channel])
        assert np.array_equal(output[channel].numpy(), expected)


@pytest.mark.usefixtures("resize_kernel")
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(("width", "height"), [(512, 512), (300, 700), (1500, 900), (64, 2000), (518, 518)])
def test_transform_equals_bicubic_resize_then_the_transcribed_torchvision_steps(preset, width, height):
    transform = PRESETS[preset]
    image = noise("RGB", width, height, seed=width)
    new_size = reference_resize(width, height, **preset_kwargs(transform), img_num=2)
    expected = transcribed_to_tensor_normalize(image.resize(new_size, Image.Resampling.BICUBIC))
    output = transform(image, img_num=2)
    assert output.dtype == torch.float32
    assert torch.equal(output, expected)


@pytest.mark.usefixtures("resize_kernel")
def test_transform_with_imagenet_statistics_equals_the_transcribed_torchvision_steps():
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    image = noise("RGB", 448, 448)
    transform = ImageTransform(448, 224, 14, image_mean=mean, image_std=std)
    assert torch.equal(transform(image), transcribed_to_tensor_normalize(image, mean, std))


def test_resize_is_skipped_at_the_target_size_and_pil_would_not_change_it():
    image = noise("RGB", 518, 518)
    assert BAGEL_VIT_TRANSFORM.output_size(image) == image.size
    assert torch.equal(BAGEL_VIT_TRANSFORM(image), transcribed_to_tensor_normalize(image))
    assert np.array_equal(np.asarray(image.resize(image.size, Image.Resampling.BICUBIC)), np.asarray(image))


def test_transform_requires_rgb():
    with pytest.raises(ValueError, match="to_rgb"):
        BAGEL_VIT_TRANSFORM(noise("L", 64, 64))


# --------------------------------------------------------------------------- patchify and position ids


@pytest.mark.parametrize(("channels", "height", "width", "p"),
                         [(3, 28, 42, 14), (3, 64, 32, 16), (2, 6, 9, 3)])
def test_patchify_orders_patches_row_major_and_pixels_row_col_channel(channels, height, width, p):
    image = torch.randn(channels, height, width)
    expected = torch.stack([image[:, r * p:(r + 1) * p, c * p:(c + 1) * p].permute(1, 2, 0).reshape(-1)
                            for r in range(height // p) for c in range(width // p)])
    assert torch.equal(patchify(image, p), expected)


def test_patchify_refuses_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="resize it first"):
        patchify(torch.zeros(3, 30, 28), 14)


@pytest.mark.parametrize(("height", "width", "p", "side"), [(518, 518, 14, 70), (224, 980, 14, 70),
                                                            (1024, 512, 16, 64), (512, 512, 16, 32)])
def test_extrapolated_position_ids_are_row_times_side_plus_col(height, width, p, side):
    expected = [r * side + c for r in range(height // p) for c in range(width // p)]
    ids = position_ids_extrapolate(height, width, p, side)
    assert ids.dtype == torch.int64 and ids.tolist() == expected


def test_extrapolated_position_ids_refuse_grids_wider_than_the_table():
    with pytest.raises(ValueError, match="max_num_patches_per_side=32"):
        position_ids_extrapolate(1024, 1024, 16, 32)


@pytest.mark.parametrize(("height", "width", "p", "side"), [(518, 518, 14, 70), (490, 980, 14, 70),
                                                            (1024, 512, 16, 32), (224, 378, 14, 35)])
def test_interpolated_position_ids_bucket_float32_coordinates(height, width, p, side):
    # The definition: coordinates i/n and boundaries k/side as float32 torch.arange values; a patch's
    # bucket is the number of boundaries at or below its coordinate.
    boundaries = torch.arange(1 / side, 1.0, 1 / side).tolist()

    def bucket(count):
        return [sum(b <= x for b in boundaries) for x in torch.arange(0, 1 - 1e-6, 1 / count).tolist()]

    expected = [r * side + c for r in bucket(height // p) for c in bucket(width // p)]
    ids = position_ids_interpolate(height, width, p, side)
    assert ids.dtype == torch.int64 and ids.tolist() == expected


@pytest.mark.parametrize(("rows", "side"), [(64, 32), (16, 64), (8, 8), (32, 16)])
def test_interpolated_position_ids_are_exact_fractions_on_dyadic_grids(rows, side):
    ids = position_ids_interpolate(rows * 16, rows * 16, 16, side)
    buckets = [i * side // rows for i in range(rows)]
    assert ids.tolist() == [r * side + c for r in buckets for c in buckets]


# --------------------------------------------------------------------------- downsize_and_reencode


def test_images_that_fit_are_kept():
    assert downsize_and_reencode(encode(noise("RGB", 300, 200), "JPEG"), 300) is None


@pytest.mark.parametrize(("image", "fmt", "options", "expected_format", "expected_mode"), [
    (noise("RGB", 900, 600), "JPEG", {}, "JPEG", "RGB"),
    (noise("CMYK", 900, 600), "JPEG", {}, "JPEG", "CMYK"),
    (noise("RGBA", 900, 600), "PNG", {}, "PNG", "RGBA"),
    (noise("L", 900, 600), "PNG", {}, "PNG", "L"),
    (palette_image(900, 600, 3), "PNG", {}, "PNG", "RGBA"),
    (palette_image(900, 600, None), "PNG", {}, "PNG", "RGB"),
    (noise("RGBA", 900, 600), "WEBP", {}, "PNG", "RGBA"),
    (noise("RGB", 900, 600), "WEBP", {}, "JPEG", "RGB"),
    (palette_image(900, 600, None), "GIF", {}, "JPEG", "RGB"),
    (palette_image(900, 600, 3), "GIF", {"transparency": 3}, "PNG", "RGBA"),
], ids=["jpeg", "jpeg-cmyk", "png-rgba", "png-l", "png-p-trns", "png-p", "webp-alpha", "webp", "gif",
        "gif-trns"])
def test_large_images_are_downsized_and_reencoded(image, fmt, options, expected_format, expected_mode):
    data = downsize_and_reencode(encode(image, fmt, **options), 300)
    assert probe(data) == ImageInfo(300, 200, expected_format, expected_mode, expected_mode in ("RGBA", "LA"))


def test_reencoded_jpeg_keeps_its_icc_profile():
    icc = b"\x00" * 128 + b"fake profile"
    data = downsize_and_reencode(encode(noise("RGB", 600, 400), "JPEG", icc_profile=icc), 150, quality=80)
    assert Image.open(io.BytesIO(data)).info["icc_profile"] == icc


# --------------------------------------------------------------------------- decode_jpeg_batch


def test_batch_decode_without_gpu_equals_decode_rgb():
    datas = [encode(noise("RGB", 40, 30), "JPEG"), encode(noise("RGBA", 20, 10), "PNG"),
             encode(noise("CMYK", 16, 16), "JPEG")]
    for data, tensor in zip(datas, decode_jpeg_batch(datas), strict=True):
        expected = np.asarray(decode_rgb(data))
        assert tensor.dtype == torch.uint8 and tensor.shape == (3, *expected.shape[:2])
        assert np.array_equal(tensor.permute(1, 2, 0).numpy(), expected)


def _gpu_decode_available() -> str | None:
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        return "torchvision is not installed (GPU JPEG decoding needs torchvision.io.decode_jpeg)"
    return None if torch.cuda.is_available() else "no CUDA device"


@pytest.mark.skipif(_gpu_decode_available() is not None, reason=str(_gpu_decode_available()))
def test_gpu_batch_decode_is_close_to_pil():
    datas = [encode(noise("RGB", 64, 48, seed=i).resize((256, 192), Image.Resampling.BICUBIC), "JPEG")
             for i in range(4)]
    for data, tensor in zip(datas, decode_jpeg_batch(datas, "cuda"), strict=True):
        assert tensor.device.type == "cuda"
        expected = torch.from_numpy(np.asarray(decode_rgb(data))).permute(2, 0, 1)
        assert (tensor.cpu().float() - expected.float()).abs().mean() < 2.0


@pytest.mark.parametrize(("width", "height"), [(1, 1), (37, 5), (512, 384), (4100, 4100)])
def test_rgb_pixels_equal_numpys_copy_whether_viewed_or_copied(width, height):
    """Small images are exported as zero-copy views of Pillow's memory; huge ones (rows in
    several blocks) fall back to a copy; both give exactly np.asarray's pixels."""
    image = noise("RGB", width, height, seed=3)
    pixels = rgb_pixels(image)
    assert pixels.shape == (height, width, 3) and pixels.dtype == np.uint8
    assert np.array_equal(pixels, np.asarray(image))
