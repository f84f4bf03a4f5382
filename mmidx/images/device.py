"""Decoding JPEGs on the device a batch lives on (nvJPEG through torchvision), when one is there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

from mmidx.images.decode import decode_rgb


def _gpu_jpeg_decoder() -> Callable[..., list[torch.Tensor]] | None:
    """torchvision's batched JPEG decoder returning RGB, or None where torchvision is not installed."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return None
    return partial(decode_jpeg, mode=ImageReadMode.RGB)


def decode_jpeg_batch(
    datas: Sequence[bytes | memoryview], device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Decode images to RGB uint8 (3, H, W) tensors on ``device``, JPEGs on the GPU when possible.

    With torchvision importable and a CUDA ``device``, JPEGs are decoded in one batched
    ``torchvision.io.decode_jpeg`` call (nvJPEG; pixels differ from libjpeg's by a few levels);
    everything else, and everything without torchvision or CUDA, goes through ``decode_rgb``
    (PIL, with BAGEL's RGB conversion).
    """
    device = torch.device(device)
    decoder = _gpu_jpeg_decoder() if device.type == "cuda" else None
    decoded: dict[int, torch.Tensor] = {}
    jpegs = [i for i, data in enumerate(datas) if bytes(data[:3]) == b"\xff\xd8\xff"]
    if decoder is not None and jpegs:
        inputs = [torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8) for i in jpegs]
        decoded.update(zip(jpegs, decoder(inputs, device=device), strict=True))
    for i, data in enumerate(datas):
        if i not in decoded:
            decoded[i] = torch.from_numpy(np.array(decode_rgb(data))).permute(2, 0, 1).to(device)
    return [decoded[i] for i in range(len(datas))]
