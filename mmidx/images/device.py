"""Decoding JPEGs on the device a batch lives on (nvJPEG through torchvision), when one is there.

A GPU whose decode was measured inexact is listed in :data:`INEXACT_GPUS` with what was measured, and decoding
on it is refused (:class:`DeviceDecodeError`) unless ``MMIDX_DEVICE_DECODE=allow`` is set. The GPU suite
(``benchmarks/gpu_suite.py``, item 2) measures it: every pixel of decodes made while the caller's stream still
has work queued, against a decode made on an idle device, and the caller's memory around them. nvJPEG's
hardware path has been reported to write before the caller's queued work has run on H100s
(meta-pytorch/torchcodec#1634, pytorch/vision#9606); no GPU is listed until the suite has measured it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

from mmidx.errors import MMIDXError
from mmidx.images.decode import decode_rgb

# torch.cuda.get_device_name() -> the measured reason decoding there is refused (e.g. "the GPU suite at <commit>:
# 134 of 200 decodes with the caller's stream busy differed from the idle decode, torchvision 0.28")
INEXACT_GPUS: dict[str, str] = {}
ALLOW_VARIABLE = "MMIDX_DEVICE_DECODE"


class DeviceDecodeError(MMIDXError, RuntimeError):
    """Images are to be decoded on a GPU where that was measured inexact (:data:`INEXACT_GPUS`)."""


def check_device_decode(gpu_name: str) -> None:
    """Refuse decoding on ``gpu_name`` where it is listed in :data:`INEXACT_GPUS`, saying what was measured and
    what to do; ``MMIDX_DEVICE_DECODE=allow`` in the environment lifts the refusal (e.g. with a fixed decoder)."""
    reason = INEXACT_GPUS.get(gpu_name)
    if reason is not None and os.environ.get(ALLOW_VARIABLE) != "allow":
        raise DeviceDecodeError(f"decoding images on the {gpu_name} is refused: {reason}; build batches with "
                                f"decode_images='loader' (the default), or set {ALLOW_VARIABLE}=allow to decode "
                                "there anyway")


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
    (PIL, with BAGEL's RGB conversion). A GPU listed in :data:`INEXACT_GPUS` is refused
    (:func:`check_device_decode`).
    """
    device = torch.device(device)
    if device.type == "cuda":
        check_device_decode(torch.cuda.get_device_name(device))
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
