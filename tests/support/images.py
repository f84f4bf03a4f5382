"""Test images: encoded, noisy and palette images, and a transcription of torchvision's ToTensor + Normalize as a
reference (torchvision itself cannot be imported beside the CPU torch of the test environment)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def junk_before_the_end_marker(data: bytes) -> bytes:
    """A JPEG with bytes between its last scan and its end marker: PIL decodes it, libjpeg warns (and the loader's
    strict decode refuses it)."""
    assert data.endswith(b"\xff\xd9")
    return data[:-2] + bytes(range(1, 17)) + data[-2:]


def noise(mode: str, width: int, height: int, seed: int = 0) -> Image.Image:
    """A random image of ``mode`` (random pixels make truncation and resizing visible)."""
    channels = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4, "CMYK": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def palette_image(width: int, height: int, transparency: int | None) -> Image.Image:
    image = noise("RGB", width, height).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    if transparency is not None:
        image.info["transparency"] = transparency
    return image


def transcribed_to_tensor_normalize(image: Image.Image, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> torch.Tensor:
    """A transcription of torchvision's documented ``ToTensor`` then ``Normalize`` on an RGB PIL image, step by step in
    float32 (uint8 HWC → CHW, ÷ 255, − mean, ÷ std). It is not torchvision: the real ``ToTensor``/``Normalize``
    are compared with mmidx in ``benchmarks/bench_pack.py --bagel-src`` (BAGEL's ``ImageTransform``),
    ``tools/check_bagel.py`` and ``benchmarks/bench_images.py --bagel-site``, where torchvision is importable."""
    tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous().to(torch.float32).div(255)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return tensor.sub_(mean_t).div_(std_t)
