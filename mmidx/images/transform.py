"""BAGEL's resize rule and ``ImageTransform``: an image's output size known from its stored size alone
(``resize_shapes``, ``num_image_tokens``), and the fused Pillow-exact resize-and-normalise kernel
(``csrc/_pixels.pyx``) that writes float32 straight into batch buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import numpy as np
import PIL
import torch
from PIL import Image

from mmidx import _pixels
from mmidx.images.decode import rgb_pixels

BAGEL_MAX_PIXELS = 14 * 14 * 9 * 1024
"""BAGEL's default pixel budget of ``ImageTransform`` (1,806,336 pixels)."""


_PILLOW_VERTICAL_FIRST = int(PIL.__version__.split(".")[0]) >= 13


def _vertical_pass_first(pixels: np.ndarray, width: int, height: int) -> bool:
    """Whether PIL's bicubic resize of ``pixels`` to (width, height) runs its vertical pass first.

    Pillow resizes in two 8-bit passes, horizontal first; since Pillow 13 (python-pillow/Pillow#9549),
    vertical first when both run and the height loses more than twice as many pixels as the width
    (read off Pillow 13.0's output on 3,864 random size pairs up to 120; tests/test_pixels.py checks it). The
    order changes the 8-bit rounding in between, so the kernel follows the installed Pillow.
    """
    in_height, in_width = pixels.shape[:2]
    return (_PILLOW_VERTICAL_FIRST and width != in_width and height < in_height
            and in_height - height > 2 * (in_width - width))


def _scale_to_stride(widths: np.ndarray, heights: np.ndarray, scale: np.ndarray,
                     stride: int) -> tuple[np.ndarray, np.ndarray]:
    """BAGEL's ``_apply_scale``: round each scaled side, then to the nearest multiple of stride (≥ stride).

    Sides are float64 holding integers below 2**53, so every operation is the one Python's
    ``round`` (half to even, like ``np.rint``) and true division perform on ints.
    """
    def side(values: np.ndarray) -> np.ndarray:
        return np.maximum(stride, np.rint(np.rint(values * scale) / stride) * stride)

    return side(widths), side(heights)


def resize_shapes(
    widths: Any, heights: Any, *, max_size: int, min_size: int, stride: int, max_pixels: int,
    img_nums: Any = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """BAGEL's ``MaxLongEdgeMinShortEdgeResize`` output size for arrays of sizes, vectorised.

    1. ``scale = max(min(max_size / long, 1), min_size / short)`` (the minimum short edge wins),
       each side rounded, then rounded to a multiple of ``stride`` (at least ``stride``);
    2. if ``w·h > max_pixels / img_num``, the ratio ``(max_pixels / img_num) / (w·h)`` scales each
       side (linearly) and step 1's rounding is applied again;
    3. if the long edge exceeds ``max_size``, it is scaled back to ``max_size`` the same way.

    Returns (new_widths, new_heights) as int64 arrays of the broadcast shape of the inputs,
    equal element for element to BAGEL's scalar Python computation.
    """
    w, h, img_num = (np.asarray(values, dtype=np.float64)
                     for values in np.broadcast_arrays(widths, heights, img_nums))
    if w.size and (min(w.min(), h.min()) < 1 or max(w.max(), h.max()) >= 2**31 or img_num.min() < 1):
        raise ValueError("image sizes must be in [1, 2**31) and img_num at least 1")
    scale = np.maximum(np.minimum(max_size / np.maximum(w, h), 1.0), min_size / np.minimum(w, h))
    w, h = _scale_to_stride(w, h, scale, stride)
    if w.size and (w * h).max() >= 2**53:
        raise ValueError(f"min_size={min_size} scales an extreme aspect ratio to over 2**53 pixels; "
                         "such sizes cannot be computed exactly")
    budget = max_pixels / img_num
    over = w * h > budget
    w2, h2 = _scale_to_stride(w, h, budget / (w * h), stride)
    w, h = np.where(over, w2, w), np.where(over, h2, h)
    long_edge = np.maximum(w, h)
    w2, h2 = _scale_to_stride(w, h, max_size / long_edge, stride)
    over = long_edge > max_size
    return np.where(over, w2, w).astype(np.int64), np.where(over, h2, h).astype(np.int64)


def resize_shape(
    width: int, height: int, *, max_size: int, min_size: int, stride: int, max_pixels: int, img_num: int = 1
) -> tuple[int, int]:
    """BAGEL's resize rule for one image: (new_width, new_height). See ``resize_shapes``."""
    new_width, new_height = resize_shapes(width, height, max_size=max_size, min_size=min_size, stride=stride,
                                          max_pixels=max_pixels, img_nums=img_num)
    return int(new_width), int(new_height)


@dataclass(frozen=True)
class ImageTransform:
    """BAGEL's ``ImageTransform``: resize by BAGEL's rule (PIL bicubic), to float32, normalise.

    Build it from a BAGEL config's ``image_transform_args`` / ``vit_image_transform_args`` with
    ``ImageTransform.from_args``. Calling it on an RGB PIL image gives BAGEL's (3, H, W) float32
    tensor bit for bit.
    """

    max_image_size: int
    min_image_size: int
    image_stride: int
    max_pixels: int = BAGEL_MAX_PIXELS
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        sizes = (self.max_image_size, self.min_image_size, self.image_stride, self.max_pixels)
        if min(sizes) < 1:
            raise ValueError(f"{self}: max_image_size, min_image_size, image_stride and max_pixels must be "
                             "positive")
        # Lists from YAML configs become tuples, so the transform stays hashable.
        object.__setattr__(self, "image_mean", tuple(float(value) for value in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(value) for value in self.image_std))
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or 0 in self.image_std:
            raise ValueError(f"{self}: image_mean and image_std need 3 values each, std non-zero")

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> ImageTransform:
        """The transform a BAGEL config's ``image_transform_args`` mapping describes."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown image transform arguments {unknown}; known: {sorted(known)}")
        return cls(**args)

    def output_shapes(self, widths: Any, heights: Any, img_nums: Any = 1) -> tuple[np.ndarray, np.ndarray]:
        """Sizes (new_widths, new_heights) this transform resizes images to; see ``resize_shapes``."""
        return resize_shapes(widths, heights, max_size=self.max_image_size, min_size=self.min_image_size,
                             stride=self.image_stride, max_pixels=self.max_pixels, img_nums=img_nums)

    def output_size(self, image: Image.Image, img_num: int = 1) -> tuple[int, int]:
        """(width, height) this transform resizes ``image`` to (BAGEL's rule)."""
        widths, heights = self.output_shapes(image.width, image.height, img_num)
        return int(widths), int(heights)

    @cached_property
    def lookup_table(self) -> np.ndarray:
        """(3, 256) float32: torchvision's normalised value of every uint8 level, per channel.

        Computed with the very float32 operations ``ToTensor`` and ``Normalize`` run (``/ 255``,
        ``- mean``, ``/ std``), so looking values up is bit-identical to running them.
        """
        levels = torch.arange(256, dtype=torch.float32).div(255).expand(3, 256)
        mean, std = (torch.tensor(v, dtype=torch.float32).view(3, 1) for v in (self.image_mean, self.image_std))
        return np.ascontiguousarray(levels.sub(mean).div(std).numpy())

    @cached_property
    def normalization(self) -> np.ndarray:
        """(2, 3) float32: the mean and the std ``lookup_table`` is computed from, for the resize kernel's
        vectorised normalise step, which computes the same values (checked level by level against the table)."""
        return np.array([self.image_mean, self.image_std], dtype=np.float32)

    def normalize_into(self, pixels: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        """Write (H, W, 3) uint8 ``pixels``, resized to out's (h, w), normalised, into the (3, h, w) CPU view ``out``.

        One fused Cython pass: Pillow's bicubic resize reproduced bit for bit (none if the sizes are
        equal), then ``lookup_table``'s values (computed with AVX2 where the CPU has it, bit-identical),
        each written once, straight into a slice of a batch buffer if ``out`` is one.
        """
        height, width = out.shape[1:]
        _pixels.render_chw(pixels, out.numpy(), self.lookup_table, _vertical_pass_first(pixels, width, height),
                           self.normalization)
        return out

    def patches_into(self, pixels: np.ndarray, out: torch.Tensor, patch_size: int,
                     height: int | None = None, width: int | None = None) -> torch.Tensor:
        """Write ``patchify(normalised image, patch_size)`` into the rows ``out``, the image being (H, W, 3)
        uint8 ``pixels`` resized to (height, width) (default: not resized), as ``normalize_into`` does."""
        height = pixels.shape[0] if height is None else height
        width = pixels.shape[1] if width is None else width
        _pixels.render_patches(pixels, out.numpy(), self.lookup_table, height, width, patch_size,
                               _vertical_pass_first(pixels, width, height), self.normalization)
        return out

    def to_tensor(self, image: Image.Image, size: tuple[int, int] | None = None) -> torch.Tensor:
        """An RGB image as BAGEL's normalised (3, H, W) float32 tensor, resized to ``size`` (width,
        height) with PIL's bicubic if given.

        Bit-identical to PIL's ``resize`` and torchvision's ``ToTensor`` + ``Normalize`` (see
        ``normalize_into``).
        """
        if image.mode != "RGB":
            raise ValueError(f"ImageTransform expects an RGB image, got mode {image.mode!r}; "
                             "convert it with to_rgb")
        width, height = size or image.size
        return self.normalize_into(rgb_pixels(image), torch.empty(3, height, width))

    def __call__(self, image: Image.Image, img_num: int = 1) -> torch.Tensor:
        """BAGEL's ``ImageTransform(image, img_num)``: resize by BAGEL's rule, then ``to_tensor``."""
        return self.to_tensor(image, self.output_size(image, img_num))


BAGEL_VAE_TRANSFORM = ImageTransform(max_image_size=1024, min_image_size=512, image_stride=16)
"""VAE images of BAGEL's t2i and edit configs."""


BAGEL_VIT_TRANSFORM = ImageTransform(max_image_size=518, min_image_size=224, image_stride=14)
"""ViT images of BAGEL's edit config."""


BAGEL_VLM_TRANSFORM = ImageTransform(max_image_size=980, min_image_size=378, image_stride=14,
                                     max_pixels=2_007_040)
"""ViT images of BAGEL's vlm_sft config."""


def num_image_tokens(
    widths: Any, heights: Any, transform: ImageTransform, *, img_nums: Any = 1, patch_size: int | None = None
) -> np.ndarray:
    """Tokens of each image after ``transform``: (H // patch_size) · (W // patch_size), int64.

    ``patch_size`` is BAGEL's ``vae_image_downsample`` (16) or ``vit_patch_size`` (14); it
    defaults to the transform's stride, which equals it in every BAGEL config. Works on arrays of
    probed sizes, so the index gets exact counts for millions of images without decoding any.
    """
    patch_size = patch_size or transform.image_stride
    new_widths, new_heights = transform.output_shapes(widths, heights, img_nums)
    return (new_heights // patch_size) * (new_widths // patch_size)
