"""The pixel side of a pack: each stored image decoded once, resized and normalised by BAGEL's transforms
straight into the batch's buffers (padded VAE inputs, ViT patches), on the CPU or, with
``decode_images="device"``, decoded where the batch lives (:class:`DeferredImages`).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmidx.format import FormatError
from mmidx.images.decode import ImageError, decode_rgb_pixels
from mmidx.images.device import decode_jpeg_batch
from mmidx.images.patches import patchify
from mmidx.images.transform import ImageTransform
from mmidx.pack.buffers import _batch_buffer
from mmidx.read.dataset import Sample


@dataclass(frozen=True)
class _ImageJob:
    """One image element to render: which stored image, through which transform, at which size."""

    key: tuple[int, int, int, int]  # (group, dataset, sample, payload)
    sample: Sample
    transform: ImageTransform
    img_num: int
    height: int
    width: int


Stage = Callable[[str], AbstractContextManager[Any]]  # stage name -> a context that times it (benchmarks)


_UNTIMED = nullcontext()


def _untimed(stage: str) -> AbstractContextManager[Any]:
    return _UNTIMED


@functools.lru_cache(maxsize=65536)
def _output_size(transform: ImageTransform, width: int, height: int, img_num: int) -> tuple[int, int]:
    """(height, width) of a stored image after ``transform``: known from its probed size, no decoding."""
    widths, heights = transform.output_shapes(width, height, img_num)
    return int(heights), int(widths)


@functools.lru_cache(maxsize=4096)
def _position_ids(function: Callable[[int, int, int, int], torch.Tensor], height: int, width: int, patch: int,
                  side: int) -> torch.Tensor:
    """``function``'s position ids of a height x width image, computed once per size (batches copy them)."""
    return function(height, width, patch, side)


def _image_name(job: _ImageJob) -> str:
    return f"{job.sample.dataset.prefix}.images: image {job.key[3]} of sample {job.key[2]}"


@contextmanager
def _named(where: str) -> Iterator[None]:
    """Re-raise an undecodable stored image as a ``FormatError`` naming the file and the image."""
    try:
        yield
    except (ImageError, RuntimeError) as error:  # RuntimeError: nvJPEG's
        raise FormatError(f"{where}: {error}: the stored image is corrupted") from error


def _check_decoded_size(where: str, probed: tuple[int, int], decoded: tuple[int, int]) -> None:
    """Both decode paths: a stored image must decode to the (width, height) its ``image_info`` records,
    from which the pack's token counts were computed."""
    if tuple(decoded) != tuple(probed):
        raise FormatError(f"{where} decodes to {decoded[0]}x{decoded[1]}, but the image table (image_info) "
                          f"says {probed[0]}x{probed[1]}: the dataset is corrupted")


class _Pixels:
    """Decoded RGB pixels of one pack's images: each stored image is decoded once, however many of ``jobs`` use it,
    and let go after its last use, so that the next image decodes into the memory it leaves (kept for the whole
    pack, a t2i pack's 24 MB of decoded images could be paged in afresh: 4,000 page faults per pack in one run)."""

    def __init__(self, jobs: Iterable[_ImageJob], stage: Stage = _untimed) -> None:
        self.decoded: dict[tuple[int, ...], np.ndarray] = {}
        self.uses = Counter(job.key for job in jobs)
        self.stage = stage

    def __call__(self, job: _ImageJob) -> np.ndarray:
        """The (H, W, 3) uint8 pixels of the stored image of ``job`` (one of the jobs given), before resizing."""
        decoded = self.decoded.pop(job.key, None)
        if decoded is None:
            image = job.sample.image(job.key[3])
            where = _image_name(job)
            with self.stage("decode"), _named(where):
                decoded = decode_rgb_pixels(image.data)
            _check_decoded_size(where, (image.width, image.height), (decoded.shape[1], decoded.shape[0]))
        self.uses[job.key] -= 1
        if self.uses[job.key] > 0:
            self.decoded[job.key] = decoded
        return decoded


def _padded_images(jobs: list[_ImageJob], pixels: _Pixels) -> torch.Tensor:
    """BAGEL's ``padded_images``: (n, 3, max H, max W) float32, each image top-left, zeros elsewhere.

    Written in place: only the padding is zeroed, and each image is resized and normalised straight into
    its slot in one pass.
    """
    height, width = max(job.height for job in jobs), max(job.width for job in jobs)
    padded = _batch_buffer(len(jobs), 3, height, width)
    for slot, job in zip(padded, jobs, strict=True):
        if job.height < height:
            slot[:, job.height:, :].zero_()
        if job.width < width:
            slot[:, : job.height, job.width:].zero_()
        job.transform.normalize_into(pixels(job), slot[:, : job.height, : job.width])
    return padded


def _vit_tokens(jobs: list[_ImageJob], counts: list[int], patch: int, pixels: _Pixels) -> torch.Tensor:
    """``packed_vit_tokens``: every image's patches (row-major; inside a patch (row, column, channel)),
    resized and normalised straight from the decoded pixels into their rows of one buffer (BAGEL's ``patchify``)."""
    tokens = _batch_buffer(sum(counts), patch * patch * 3)
    start = 0
    for job, count in zip(jobs, counts, strict=True):
        job.transform.patches_into(pixels(job), tokens[start:start + count], patch, job.height, job.width)
        start += count
    return tokens


@dataclass
class DeferredImages:
    """A pack's images, still encoded, with what each image element needs: decoded on the device.

    ``encoded`` holds each distinct stored image once (uint8 CPU tensors of its bytes); ``vae`` and
    ``vit`` list, in element order, (image number, transform, height, width). The same code runs
    on CPU and CUDA: decode (:func:`mmidx.images.device.decode_jpeg_batch`), resize with antialiased
    bicubic, normalise with torchvision's float32 arithmetic, write the batch keys.
    """

    encoded: list[torch.Tensor]
    vae: list[tuple[int, ImageTransform, int, int]]
    vit: list[tuple[int, ImageTransform, int, int]]
    patch_size: int
    probed: list[tuple[str, int, int]]  # per encoded image: where it is stored, its image_info width, height

    @classmethod
    def of(cls, vae_jobs: list[_ImageJob], vit_jobs: list[_ImageJob], patch_size: int) -> DeferredImages:
        numbers: dict[tuple[int, ...], int] = {}
        encoded: list[torch.Tensor] = []
        probed: list[tuple[str, int, int]] = []
        for job in [*vae_jobs, *vit_jobs]:
            if job.key not in numbers:
                numbers[job.key] = len(encoded)
                image = job.sample.image(job.key[3])
                encoded.append(torch.frombuffer(bytearray(image.data), dtype=torch.uint8))
                probed.append((_image_name(job), image.width, image.height))

        def entries(jobs: list[_ImageJob]) -> list[tuple[int, ImageTransform, int, int]]:
            return [(numbers[job.key], job.transform, job.height, job.width) for job in jobs]

        return cls(encoded, entries(vae_jobs), entries(vit_jobs), patch_size, probed)

    def pin_memory(self) -> DeferredImages:
        return DeferredImages([data.pin_memory() for data in self.encoded], self.vae, self.vit, self.patch_size,
                              self.probed)

    def render(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """``padded_images`` and ``packed_vit_tokens`` (those present) on ``device``."""
        with _named(", ".join(sorted({where.split(":")[0] for where, _, _ in self.probed}))):
            decoded = decode_jpeg_batch([data.numpy() for data in self.encoded], device)
        for (where, width, height), pixels in zip(self.probed, decoded, strict=True):
            _check_decoded_size(where, (width, height), (pixels.shape[2], pixels.shape[1]))
        resized: dict[tuple[int, int, int], torch.Tensor] = {}

        def image(number: int, transform: ImageTransform, height: int, width: int) -> torch.Tensor:
            if (number, height, width) not in resized:
                pixels = decoded[number].float()[None]
                # PIL resizes the width, rounds and clips to 8 bits, then the height: so does this (one
                # 2-D pass instead differs by up to 24 levels where bicubic overshoots, e.g. on noise).
                for size in ((pixels.shape[2], width), (height, width)):
                    if pixels.shape[2:] != size:
                        pixels = torch.nn.functional.interpolate(pixels, size=size, mode="bicubic", antialias=True,
                                                                 align_corners=False).round_().clamp_(0, 255)
                resized[number, height, width] = pixels[0]
            pixels = resized[number, height, width]
            mean, std = (torch.tensor(v, dtype=torch.float32, device=pixels.device).view(3, 1, 1)
                         for v in (transform.image_mean, transform.image_std))
            return pixels.div(255).sub_(mean).div_(std)

        out: dict[str, torch.Tensor] = {}
        if self.vae:
            height, width = max(entry[2] for entry in self.vae), max(entry[3] for entry in self.vae)
            padded = torch.zeros(len(self.vae), 3, height, width, device=device)
            for slot, entry in zip(padded, self.vae, strict=True):
                slot[:, : entry[2], : entry[3]] = image(*entry)
            out["padded_images"] = padded
        if self.vit:
            out["packed_vit_tokens"] = torch.cat([patchify(image(*entry), self.patch_size) for entry in self.vit])
        return out
