"""Images at build time: probed as stored, and downsized and re-encoded when --max-image-size asks for it."""

import io
import json

import pyarrow as pa
import pytest
from PIL import Image
from support.sources import build, decoded, image_bytes, write_parquet


def _build_images(tmp_path, images, **options):
    path = write_parquet(tmp_path / "t2i.parquet",
                         {"image": images, "captions": [json.dumps({"0": "x"})] * len(images)},
                         {"image": pa.binary(), "captions": pa.string()}, row_group_size=10)
    dataset, _ = build("t2i", [path], tmp_path / "out", **options)
    return [dataset[i].image(0) for i in range(len(dataset))]


@pytest.mark.parametrize(("mode", "fmt"), [("RGB", "JPEG"), ("RGBA", "PNG"), ("L", "PNG"), ("CMYK", "JPEG")])
def test_oversized_images_are_downsized_to_the_cap_and_reencoded_in_their_format(tmp_path, mode, fmt):
    original = image_bytes(200, 100, mode, fmt, seed=4)
    (stored,) = _build_images(tmp_path, [original], max_image_size=64)
    pil = Image.open(io.BytesIO(bytes(stored.data)))
    assert (stored.width, stored.height) == pil.size == (64, 32)
    assert (stored.format, stored.mode) == (pil.format, pil.mode) and stored.format == fmt
    assert stored.has_transparency == (mode == "RGBA")


def test_downsized_pixels_are_the_original_scaled_down(tmp_path):
    original = image_bytes(256, 128, "RGB", "PNG", seed=5)
    (stored,) = _build_images(tmp_path, [original], max_image_size=64)
    expected = Image.open(io.BytesIO(original)).resize((64, 32), Image.Resampling.LANCZOS)
    assert abs(decoded(stored.data).astype(int) - decoded(_png(expected)).astype(int)).mean() < 2


def _png(image):
    output = io.BytesIO()
    image.save(output, format="PNG")
    return output.getvalue()


def test_images_within_the_cap_keep_their_bytes(tmp_path):
    original = image_bytes(64, 40, "RGB", "JPEG", seed=6)
    (stored,) = _build_images(tmp_path, [original], max_image_size=64)
    assert bytes(stored.data) == original and (stored.width, stored.height) == (64, 40)


def test_without_a_cap_large_images_are_stored_as_given(tmp_path):
    original = image_bytes(300, 200, "RGB", "JPEG", seed=7)
    (stored,) = _build_images(tmp_path, [original])
    assert bytes(stored.data) == original and (stored.width, stored.height) == (300, 200)
