"""Images: probe, decode, BAGEL's resize rule, tensors, patchify and position ids.

mmidx stores images as their encoded bytes and probes width, height, format and mode at build time,
so the index can compute every image's token count without decoding it (``num_image_tokens``).
At read time an image is decoded, converted to RGB, resized and normalised exactly as BAGEL's
``pil_img2rgb`` and ``ImageTransform`` do (``data/data_utils.py``, ``data/transforms.py`` at
commit 056b5fd), then cut into ViT patches with BAGEL's position ids. Nothing here needs
torchvision: its only BAGEL-relevant behaviour on PIL images is PIL's bicubic resize, ``/255`` in
float32 and a float32 subtract/divide, which this module reproduces bit for bit: one Cython pass
(``csrc/_pixels.pyx``) resizes the decoded pixels with Pillow's own fixed-point bicubic arithmetic
and writes normalised float32 straight into the batch buffers.

BAGEL quirks reproduced on purpose (a trainer that was tuned on BAGEL sees the same pixels):

* ``to_rgb`` composites on white only ``RGBA`` images and images whose ``info`` carries a
  ``transparency`` entry (``P``/``L``/``RGB`` with a tRNS chunk, GIF). ``LA`` and ``PA`` images
  keep alpha as a channel, not in ``info``, so their alpha is dropped, not composited.
* EXIF orientation is ignored: sizes are the stored ones, as BAGEL decodes them.
* The resize rule rounds with Python's ``round`` (half to even), so a 520² image becomes 512², not
  528², with stride 16; the ``max_pixels`` ratio is applied to each side linearly (not its square
  root), so an image over the pixel budget shrinks by the budget ratio per side, and may end below
  ``min_size`` (980² with the vlm preset and ``img_num=12`` becomes 168², not about 409²).
* ``position_ids_interpolate`` decides ties between a patch coordinate and a grid boundary by
  the float32 values ``torch.arange`` produces, not by exact arithmetic; it calls the same torch
  operations as BAGEL so that the ids are the same on the same machine.
"""

from __future__ import annotations

import io
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property, partial
from typing import Any

import numpy as np
import PIL
import pyarrow
import simplejpeg
import torch
from PIL import Image, ImageFile

from mmidx import _pixels
from mmidx.format import IMAGE_DTYPE, IMAGE_FLAG_TRANSPARENCY, IMAGE_FORMATS, IMAGE_MODES

DEFAULT_MAX_PIXELS = 2**27
"""Largest width·height ``probe`` and the decoders accept by default (a decompression-bomb guard).

Below PIL's own default limit (2 × ``PIL.Image.MAX_IMAGE_PIXELS`` = 178,956,970), so that by
default it is this check that decides, with a message that names the size.
"""

BAGEL_MAX_PIXELS = 14 * 14 * 9 * 1024
"""BAGEL's default pixel budget of ``ImageTransform`` (1,806,336 pixels)."""

_PILLOW_VERTICAL_FIRST = int(PIL.__version__.split(".")[0]) >= 13

# Exceptions PIL raises for data it cannot identify or decode.
_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error,
               Image.DecompressionBombError)


class ImageError(ValueError):
    """Encoded image data that cannot be used: unrecognised, undecodable, truncated or too large."""


# --------------------------------------------------------------------------- probe and decode


@dataclass(frozen=True)
class ImageInfo:
    """What the header of an encoded image says, in the vocabulary of ``mmidx.format``.

    ``format`` is a name from ``IMAGE_FORMATS`` and ``mode`` one from ``IMAGE_MODES``
    (``"unknown"`` for anything else PIL can open).
    """

    width: int
    height: int
    format: str
    mode: str
    has_transparency: bool

    def record(self) -> np.void:
        """This info as one ``IMAGE_DTYPE`` record, the form ``P.plan``'s ``image_info`` stores."""
        flags = IMAGE_FLAG_TRANSPARENCY if self.has_transparency else 0
        codes = (IMAGE_FORMATS.index(self.format), IMAGE_MODES.index(self.mode))
        return np.array((self.width, self.height, *codes, flags, 0), dtype=IMAGE_DTYPE)[()]

    @classmethod
    def from_record(cls, record: np.void) -> ImageInfo:
        """The info an ``IMAGE_DTYPE`` record holds (inverse of ``record``)."""
        return cls(int(record["width"]), int(record["height"]), IMAGE_FORMATS[record["format"]],
                   IMAGE_MODES[record["mode"]], bool(record["flags"] & IMAGE_FLAG_TRANSPARENCY))


def _open(data: bytes | memoryview, max_pixels: int) -> ImageFile.ImageFile:
    """Open ``data`` lazily (header only) and refuse it if it is not an image or has too many pixels.

    PIL's own guard reads the process-wide ``Image.MAX_IMAGE_PIXELS`` inside ``Image.open``: it
    raises above twice that value (before ``max_pixels`` could be consulted) and warns above it.
    So ``max_pixels`` may not exceed PIL's limit, and PIL's warning is silenced because the size
    is checked here, before anything is decoded.
    """
    pil_limit = Image.MAX_IMAGE_PIXELS
    if pil_limit is not None and max_pixels > 2 * pil_limit:
        raise ValueError(f"max_pixels={max_pixels} is above PIL's own decompression-bomb limit "
                         f"(2 × PIL.Image.MAX_IMAGE_PIXELS = {2 * pil_limit}), which would refuse such "
                         "images first; set PIL.Image.MAX_IMAGE_PIXELS = max_pixels // 2 in this process")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as error:
        raise ImageError(f"decompression bomb refused: {error}") from error
    except _PIL_ERRORS as error:
        raise ImageError(f"not a readable image ({len(data)} bytes starting {bytes(data[:8])!r}): "
                         f"{error}") from error
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"decompression bomb refused: image of {width}x{height} = {width * height} pixels "
                         f"exceeds max_pixels={max_pixels}; pass a larger max_pixels if such images are "
                         "legitimate")
    return image


def _info(image: Image.Image) -> ImageInfo:
    name = image.format if image.format in IMAGE_FORMATS else "unknown"
    mode = image.mode if image.mode in IMAGE_MODES else "unknown"
    return ImageInfo(image.width, image.height, name, mode, image.has_transparency_data)


def probe(data: bytes | memoryview, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageInfo:
    """Width, height, format, mode and transparency of an encoded image, from its header only.

    Raises ``ImageError`` if PIL does not recognise the data or the image has more than
    ``max_pixels`` pixels; no pixel memory is allocated either way.
    """
    return _info(_open(data, max_pixels))


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB as BAGEL's ``pil_img2rgb`` does: alpha composited on white, else ``convert``.

    Compositing applies to RGBA images and to images with a ``transparency`` entry in ``info``;
    ``LA``/``PA`` alpha is dropped, not composited, exactly as in BAGEL.
    """
    if image.mode == "RGBA" or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.getchannel("A"))
        return white
    if image.mode == "RGB":  # convert("RGB") would return the same pixels, copied
        image.load()
        return image
    return image.convert("RGB")


def rgb_pixels(image: Image.Image) -> np.ndarray:
    """The (H, W, 3) uint8 pixels of an RGB image, as a zero-copy view where Pillow can export one.

    Pillow (11.2 and newer) exports images through the Arrow C data interface, RGB as 4 bytes per
    pixel: a strided view of its own memory, against a copy through ``tobytes`` (0.02 ms vs 1.2 ms
    for 512², measured here). Images whose rows are not one block, or older Pillows, are copied.
    """
    try:
        values = pyarrow.array(image).values.buffers()[1]
        return np.frombuffer(values, np.uint8).reshape(image.height, image.width, 4)[:, :, :3]
    except (AttributeError, TypeError, ValueError, pyarrow.ArrowException):
        return np.asarray(image)


def _decoded_rgb(image: ImageFile.ImageFile, data: bytes | memoryview) -> Image.Image:
    """``to_rgb`` of an opened image (this decodes it), with PIL's decoding errors as ``ImageError``."""
    try:
        return to_rgb(image)
    except _PIL_ERRORS as error:
        raise ImageError(f"cannot decode {image.format} image of {image.width}x{image.height} "
                         f"({len(data)} bytes): {error}") from error


def decode_rgb(data: bytes | memoryview, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode encoded image bytes fully and convert them to RGB with ``to_rgb``.

    Raises ``ImageError`` for unreadable, truncated or oversized data. Truncated files are refused
    only while ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` is False (PIL's default); with it set, PIL
    pads them silently.
    """
    return _decoded_rgb(_open(data, max_pixels), data)


def decode_rgb_pixels(data: bytes | memoryview, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """``rgb_pixels(decode_rgb(data))``: the (H, W, 3) uint8 pixels BAGEL's ``pil_img2rgb`` gives, faster for JPEGs.

    Baseline and progressive YCbCr or greyscale JPEGs are decoded by simplejpeg: libjpeg-turbo as in
    PIL, with the same settings (accurate integer DCT, smooth upsampling), so the pixels are PIL's,
    in 1.23 ms instead of 1.64 ms for a 512² photo (``benchmarks/bench_images.py``); every other
    image goes through PIL. Raises ``ImageError`` as ``decode_rgb`` does.
    """
    if bytes(data[:3]) == b"\xff\xd8\xff":
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            colorspace = None  # let PIL decide and word the error
        if colorspace in ("YCbCr", "Gray"):
            if width * height > max_pixels:
                raise ImageError(f"decompression bomb refused: image of {width}x{height} = {width * height} "
                                 f"pixels exceeds max_pixels={max_pixels}; pass a larger max_pixels if such "
                                 "images are legitimate")
            try:
                return simplejpeg.decode_jpeg(data, colorspace="RGB")
            except ValueError as error:
                raise ImageError(f"cannot decode JPEG image of {width}x{height} ({len(data)} bytes): "
                                 f"{error}") from error
    return rgb_pixels(decode_rgb(data, max_pixels=max_pixels))


def verify_decodable(data: bytes | memoryview, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageInfo:
    """Probe ``data`` and decode it fully the way the reader will, so a bad image fails at build time.

    Returns the probed info. Raises ``ImageError`` for unreadable, truncated or oversized data,
    and ``RuntimeError`` if ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` is set, because PIL would
    then pad truncated images silently and this check would pass them.
    """
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True, so truncated images decode silently "
                           "padded and cannot be detected; set it to False before verifying images")
    image = _open(data, max_pixels)
    info = _info(image)
    _decoded_rgb(image, data)
    return info


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


# --------------------------------------------------------------------------- BAGEL's resize rule


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


# --------------------------------------------------------------------------- ImageTransform


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

    def normalize_into(self, pixels: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        """Write (H, W, 3) uint8 ``pixels``, resized to out's (h, w), normalised, into the (3, h, w) CPU view ``out``.

        One fused Cython pass: Pillow's bicubic resize reproduced bit for bit (none if the sizes are
        equal), then ``lookup_table``, each value written once, straight into a slice of a batch
        buffer if ``out`` is one.
        """
        height, width = out.shape[1:]
        _pixels.render_chw(pixels, out.numpy(), self.lookup_table, _vertical_pass_first(pixels, width, height))
        return out

    def patches_into(self, pixels: np.ndarray, out: torch.Tensor, patch_size: int,
                     height: int | None = None, width: int | None = None) -> torch.Tensor:
        """Write ``patchify(normalised image, patch_size)`` into the rows ``out``, the image being (H, W, 3)
        uint8 ``pixels`` resized to (height, width) (default: not resized), as ``normalize_into`` does."""
        height = pixels.shape[0] if height is None else height
        width = pixels.shape[1] if width is None else width
        _pixels.render_patches(pixels, out.numpy(), self.lookup_table, height, width, patch_size,
                               _vertical_pass_first(pixels, width, height))
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


# --------------------------------------------------------------------------- patches and position ids


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(C, H, W) → (H/p · W/p, p·p·C): patches in row-major order, each flattened as (p_row, p_col, C)."""
    channels, height, width = image.shape
    p = patch_size
    if height % p or width % p:
        raise ValueError(f"image of {height}x{width} does not divide into {p}x{p} patches; resize it first")
    patches = image.reshape(channels, height // p, p, width // p, p).permute(1, 3, 2, 4, 0)
    return patches.reshape(-1, p * p * channels)


def _grid(height: int, width: int, patch_size: int) -> tuple[int, int]:
    rows, cols = height // patch_size, width // patch_size
    if rows < 1 or cols < 1:
        raise ValueError(f"image of {height}x{width} is smaller than one {patch_size}x{patch_size} patch")
    return rows, cols


def position_ids_extrapolate(
    height: int, width: int, patch_size: int, max_num_patches_per_side: int
) -> torch.Tensor:
    """BAGEL's default position ids: ``row · max_num_patches_per_side + col`` per patch, int64.

    Refuses grids wider or taller than ``max_num_patches_per_side``: their ids would collide with
    the next row's and overrun the model's position table (e.g. 1024² VAE images need a
    ``max_latent_size`` of 64, not the default 32).
    """
    rows, cols = _grid(height, width, patch_size)
    if max(rows, cols) > max_num_patches_per_side:
        raise ValueError(f"a {rows}x{cols} patch grid does not fit max_num_patches_per_side="
                         f"{max_num_patches_per_side}; raise it (max_latent_size / max_num_patch_per_side)")
    return (torch.arange(rows)[:, None] * max_num_patches_per_side + torch.arange(cols)).flatten()


def position_ids_interpolate(
    height: int, width: int, patch_size: int, max_num_patches_per_side: int
) -> torch.Tensor:
    """BAGEL's interpolated position ids: each patch's fractional coordinate bucketed into the grid, int64.

    Uses the float32 ``torch.arange`` values and ``torch.bucketize(right=True)`` BAGEL uses, since
    those values (not exact fractions) decide patches that fall on a grid boundary.
    """
    rows, cols = _grid(height, width, patch_size)
    side = max_num_patches_per_side
    boundaries = torch.arange(1 / side, 1.0, 1 / side, dtype=torch.float32)

    def buckets(count: int) -> torch.Tensor:
        coords = torch.arange(0, 1 - 1e-6, 1 / count, dtype=torch.float32)
        return torch.bucketize(coords, boundaries, right=True)

    return (buckets(rows)[:, None] * side + buckets(cols)).flatten()


# --------------------------------------------------------------------------- build-time size cap


def _reencode_plan(image: Image.Image) -> tuple[str, str]:
    """(target format, mode to convert to) for re-encoding ``image``: JPEG stays JPEG, PNG stays PNG,
    anything else becomes PNG if it has transparency, else JPEG."""
    transparent = image.has_transparency_data
    if image.format in ("JPEG", "MPO"):
        target = "JPEG"
    else:
        target = "PNG" if image.format == "PNG" or transparent else "JPEG"
    allowed = ("L", "RGB", "CMYK") if target == "JPEG" else ("L", "LA", "RGB", "RGBA", "I", "I;16")
    keeps_alpha_in_info = transparent and image.mode not in ("LA", "RGBA")
    if image.mode in allowed and not keeps_alpha_in_info:
        return target, image.mode
    return target, "RGBA" if transparent else "RGB"


def downsize_and_reencode(
    data: bytes | memoryview, max_size: int, *, quality: int = 95, max_pixels: int = DEFAULT_MAX_PIXELS
) -> bytes | None:
    """Cap an image's long edge at ``max_size`` (the builder's ``--max-image-size``).

    Returns None if the image already fits (keep the original bytes). Otherwise resizes it with
    PIL's Lanczos filter keeping the aspect ratio, and re-encodes it (ICC profile and EXIF kept):
    JPEG as JPEG at ``quality``, PNG as PNG, other formats as PNG if they have transparency, else
    JPEG. Palette images and colour-key transparency become RGB/RGBA first so the filter can
    blend. Only the first frame of an animation is kept. Token counts must then come from probing
    the new bytes.
    """
    image = _open(data, max_pixels)
    long_edge = max(image.size)
    if long_edge <= max_size:
        return None
    target, mode = _reencode_plan(image)
    size = tuple(max(1, round(side * max_size / long_edge)) for side in image.size)
    try:
        resized = image.convert(mode).resize(size, Image.Resampling.LANCZOS)
    except _PIL_ERRORS as error:
        raise ImageError(f"cannot decode {image.format} image of {image.width}x{image.height}: "
                         f"{error}") from error
    options = {key: image.info[key] for key in ("icc_profile", "exif") if image.info.get(key)}
    if target == "JPEG":
        options["quality"] = quality
    output = io.BytesIO()
    resized.save(output, format=target, **options)
    return output.getvalue()


# --------------------------------------------------------------------------- optional GPU decode


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
