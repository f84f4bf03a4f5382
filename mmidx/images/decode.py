"""Probe and decode stored images: size, format and mode read from the header (``probe``), decoded to RGB
as BAGEL's ``pil_img2rgb`` does (``decode_rgb``, ``decode_rgb_pixels``: the loader's decode), checked to decode
as the loader decodes them (``verify_decodable`` for ``mmidx verify --decode``, ``check_decodes`` at build time),
and, at build time, capped in size and re-encoded when the user asks (``downsize_and_reencode``). Every decode
is bounded by a pixel limit checked before any pixel is decoded.
"""

from __future__ import annotations

import io
import re
import struct
import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow
import simplejpeg
from PIL import Image, ImageFile, UnidentifiedImageError

from mmidx.errors import MMIDXError
from mmidx.format import IMAGE_DTYPE, IMAGE_FLAG_TRANSPARENCY, IMAGE_FORMATS, IMAGE_MODES

DEFAULT_MAX_PIXELS = 2**27
"""Largest width·height ``probe`` and the decoders accept by default (a decompression-bomb guard).

Below PIL's own default limit (2 × ``PIL.Image.MAX_IMAGE_PIXELS`` = 178,956,970), so that by
default it is this check that decides, with a message that names the size.
"""


# Exceptions PIL raises for data it cannot identify or decode.
_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error,
               Image.DecompressionBombError)


class ImageError(MMIDXError, ValueError):
    """Encoded image data that cannot be used: unrecognised, undecodable, truncated or too large."""


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
    except Image.DecompressionBombError as error:  # above PIL's limit, itself at least max_pixels / 2
        pixels = re.search(r"\((\d+) pixels\)", str(error))
        size = f"{int(pixels[1]):,} pixels" if pixels else "more pixels than PIL opens"
        raise ImageError(f"decompression bomb refused: image of {size} exceeds max_pixels={max_pixels} "
                         "(--max-image-pixels); pass a larger max_pixels if such images are legitimate") from error
    except _PIL_ERRORS as error:
        raise ImageError(f"not a readable image ({len(data)} bytes starting {bytes(data[:8])!r}): "
                         f"{pil_reason(error)}") from error
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"decompression bomb refused: image of {width}x{height} = {width * height:,} pixels "
                         f"exceeds max_pixels={max_pixels} (--max-image-pixels); pass a larger max_pixels if such "
                         "images are legitimate")
    return image


def pil_reason(error: BaseException) -> str:
    """PIL's message without the repr of the in-memory stream it read (``<_io.BytesIO object at 0x…>``), which
    names nothing a user can find: the caller's message names the file or row."""
    if isinstance(error, UnidentifiedImageError):
        return "not an image format PIL recognises"
    return re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(error)) or type(error).__name__


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
                         f"({len(data)} bytes): {pil_reason(error)}") from error


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


def open_image(data: bytes | memoryview, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[Image.Image, ImageInfo]:
    """``probe``, keeping the image opened from the header (nothing decoded yet) for ``check_decodes``,
    so that a probe followed by a check parses the header once."""
    image = _open(data, max_pixels)
    return image, _info(image)


def _refuse_padded_truncation() -> None:
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True, so truncated images decode silently "
                           "padded and cannot be detected; set it to False before verifying or building images")


def check_decodes(image: ImageFile.ImageFile, data: bytes | memoryview, info: ImageInfo) -> None:
    """Refuse (``ImageError``) an image from ``open_image(data)`` that the loader's ``decode_rgb_pixels`` would
    refuse, at a fraction of a full decode's cost: the build's check, so nothing is stored that a pack then fails on.

    YCbCr and greyscale JPEGs are decoded by simplejpeg as the loader decodes them (libjpeg-turbo in strict mode,
    which refuses what libjpeg only warns about: junk before a marker, a truncated stream, corrupt entropy data)
    but scaled to 1/8 of each side and to luma only: every entropy-coded byte of every component is still read,
    so it refuses exactly what the full decode refuses (``tests/test_images.py`` checks this on mutated JPEGs),
    in about a fifth of its time. Other JPEGs (CMYK, YCCK) are decoded in PIL's draft mode, every other format
    fully, as the loader decodes them (PIL).
    """
    _refuse_padded_truncation()
    if info.format not in _SCALABLE_FORMATS:
        _decoded_rgb(image, data)
        return
    try:
        colorspace = simplejpeg.decode_jpeg_header(data)[2]
    except ValueError:
        colorspace = None  # let PIL word the error
    try:
        if colorspace in ("YCbCr", "Gray"):
            simplejpeg.decode_jpeg(data, colorspace="GRAY", min_height=1, min_width=1, strict=True)
            return
        image.draft(image.mode, (max(1, info.width // 8), max(1, info.height // 8)))
        image.load()
    except _PIL_ERRORS as error:  # simplejpeg's errors are ValueErrors
        raise ImageError(f"cannot decode {info.format} image of {info.width}x{info.height} ({len(data)} bytes): "
                         f"{pil_reason(error)}") from error


_SCALABLE_FORMATS = ("JPEG", "MPO")  # checked by a decode scaled to 1/8 (``check_decodes``)


def verify_decodable(data: bytes | memoryview, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageInfo:
    """Probe ``data`` and decode it fully with the loader's own decoder (``decode_rgb_pixels``: simplejpeg in
    strict mode for YCbCr and greyscale JPEGs, PIL otherwise), so that an image it passes is one every pack
    holding it decodes; what ``mmidx verify --decode`` runs on every stored image.

    Returns the probed info. Raises ``ImageError`` for unreadable, truncated or oversized data, or data that
    decodes to another size than its header says, and ``RuntimeError`` if ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES``
    is set, because PIL would then pad truncated images silently and this check would pass them.
    """
    _refuse_padded_truncation()
    info = probe(data, max_pixels=max_pixels)
    height, width = decode_rgb_pixels(data, max_pixels=max_pixels).shape[:2]
    if (width, height) != (info.width, info.height):
        raise ImageError(f"a {info.format} image whose header says {info.width}x{info.height} decodes to "
                         f"{width}x{height}")
    return info


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
                         f"{pil_reason(error)}") from error
    options = {key: image.info[key] for key in ("icc_profile", "exif") if image.info.get(key)}
    if target == "JPEG":
        options["quality"] = quality
    output = io.BytesIO()
    resized.save(output, format=target, **options)
    return output.getvalue()
