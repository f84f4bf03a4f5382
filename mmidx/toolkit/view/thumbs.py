"""Images as a browser gets them: thumbnails made on demand and cached, stored images served as stored.

A stored JPEG, PNG, WebP, GIF or BMP of at most ``MAX_AS_STORED`` bytes goes out as its own bytes
(zero-copy from the mapped file); any other (TIFF, JPEG 2000, or a very large file) is decoded and
re-encoded, no larger than ``MAX_SIDE`` pixels a side. Decoding refuses images over ``MAX_PIXELS``
(the decompression-bomb guard of :mod:`mmidx.images`) and at most ``DECODERS`` run at once, so no
request can make the viewer hold more than a bounded amount of pixel memory.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from collections.abc import Callable

from PIL import Image

from mmidx.images.decode import decode_rgb
from mmidx.read.dataset import ImageRecord

THUMBNAIL_SIDE = 192
MAX_SIDE = 4096
MAX_AS_STORED = 16 << 20
MAX_PIXELS = 2**25
DECODERS = 2
CACHE_BYTES = 64 << 20
MEDIA_TYPES = {"JPEG": "image/jpeg", "MPO": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp",
               "GIF": "image/gif", "BMP": "image/bmp"}


class ImageCache:
    """Encoded images by key, least recently used dropped first, at most ``capacity`` bytes in all."""

    def __init__(self, capacity: int = CACHE_BYTES):
        self.capacity = capacity
        self._items: OrderedDict[object, tuple[bytes, str]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: object, make: Callable[[], tuple[bytes, str]]) -> tuple[bytes, str]:
        """The cached (bytes, media type) of ``key``, made by ``make()`` when absent."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()  # outside the lock: other keys are served meanwhile (two makers of one key waste, not err)
        with self._lock:
            if key not in self._items and len(value[0]) <= self.capacity:
                self._items[key] = value
                self._bytes += len(value[0])
                while self._bytes > self.capacity:
                    _, (data, _) = self._items.popitem(last=False)
                    self._bytes -= len(data)
        return value

    def __len__(self) -> int:
        return len(self._items)


_decoders = threading.BoundedSemaphore(DECODERS)


def _decoded(record: ImageRecord, side: int) -> Image.Image:
    """The RGB pixels of a stored image (as BAGEL converts them), shrunk to fit ``side`` × ``side``."""
    with _decoders:
        image = decode_rgb(record.data, max_pixels=MAX_PIXELS)  # ImageError: unreadable or too large
        if max(image.size) > side:
            image.thumbnail((side, side), Image.Resampling.LANCZOS)
        return image


def thumbnail(record: ImageRecord) -> tuple[bytes, str]:
    """A JPEG at most ``THUMBNAIL_SIDE`` pixels a side of a stored image."""
    out = io.BytesIO()
    _decoded(record, THUMBNAIL_SIDE).save(out, "JPEG", quality=82)
    return out.getvalue(), "image/jpeg"


def served_as_stored(record: ImageRecord) -> bool:
    """Whether a browser gets the stored bytes themselves (else a re-encoded copy)."""
    return record.format in MEDIA_TYPES and len(record.data) <= MAX_AS_STORED


def browser_image(record: ImageRecord) -> tuple[bytes | memoryview, str]:
    """What a browser is sent for a stored image: its own bytes when it can show them and they are not
    too large, else a PNG of its pixels (at most ``MAX_SIDE`` a side)."""
    if served_as_stored(record):
        return record.data, MEDIA_TYPES[record.format]
    out = io.BytesIO()
    _decoded(record, MAX_SIDE).save(out, "PNG", compress_level=3)
    return out.getvalue(), "image/png"
