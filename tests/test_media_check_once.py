"""The build's image check parses an image's header once: ``open_image`` probes and keeps the opened image,
``check_decodes`` decodes that same image; PNG/WebP/GIF are still refused when truncated or corrupt."""

from __future__ import annotations

import pytest
from PIL import Image, ImageFile
from support.sources import image_bytes

from mmidx.images import decode
from mmidx.images.decode import ImageError, check_decodes, open_image, probe, verify_decodable
from mmidx.sources import Skipped, SourceContext, SourceOptions
from mmidx.sources.media import ingest_image

FORMATS = [("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "P"), ("WEBP", "RGB"), ("WEBP", "RGBA"), ("GIF", "P"),
           ("JPEG", "RGB"), ("JPEG", "CMYK")]


def _context() -> SourceContext:
    return SourceContext(None, SourceOptions())


@pytest.mark.parametrize(("fmt", "mode"), FORMATS)
def test_open_image_gives_probes_info_and_check_decodes_agrees_with_verify_decodable(fmt, mode):
    data = image_bytes(60, 40, mode, fmt, seed=3)
    image, info = open_image(data)
    assert info == probe(data) == verify_decodable(data)
    check_decodes(image, data, info)  # decodes without raising, as verify_decodable did


@pytest.mark.parametrize(("fmt", "mode"), [("PNG", "RGB"), ("PNG", "RGBA"), ("GIF", "P")])
def test_a_truncated_image_passes_open_image_and_is_refused_by_check_decodes(fmt, mode):
    data = image_bytes(200, 150, mode, fmt, seed=4)
    truncated = data[:len(data) * 2 // 3]
    image, info = open_image(truncated)
    assert (info.width, info.height) == (200, 150)  # the header is intact
    with pytest.raises(ImageError):
        check_decodes(image, truncated, info)
    with pytest.raises(Skipped) as skipped:
        ingest_image(truncated, _context())
    assert skipped.value.reason == "undecodable_image"


@pytest.mark.parametrize("cut", [1 / 3, 2 / 3, 0.99])
def test_a_truncated_webp_is_refused_by_ingest(cut):
    data = image_bytes(200, 150, "RGB", "WEBP", seed=4)
    with pytest.raises(Skipped) as skipped:
        ingest_image(data[:int(len(data) * cut)], _context())
    assert skipped.value.reason == "undecodable_image"


def test_check_decodes_refuses_to_run_while_pil_pads_truncated_images(monkeypatch):
    data = image_bytes(8, 8, "RGB", "PNG")
    image, info = open_image(data)
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        check_decodes(image, data, info)


@pytest.mark.parametrize(("fmt", "mode"), FORMATS)
def test_ingest_opens_each_image_once_and_stores_it_as_given(fmt, mode, monkeypatch):
    data = image_bytes(64, 48, mode, fmt, seed=5)
    opened = []
    real_open = Image.open

    def counting_open(*args, **kwargs):
        opened.append(fmt)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(decode.Image, "open", counting_open)
    stored = ingest_image(data, _context())
    assert len(opened) == 1
    assert stored.data == data and (stored.width, stored.height, stored.format) == (64, 48, probe(data).format)
