"""Images and video frames at build time: the one place where media are checked, capped and stored.

Every image a source stores passes :func:`ingest_image`:

1. ``mmidx.images.probe`` reads the header only (width, height, format, mode, transparency);
   images above ``max_image_pixels`` (decompression bombs) are refused before any pixel is decoded.
2. The image must decode, so that a truncated or corrupt file fails here and not in a training
   job. JPEGs are decoded in PIL's draft mode (libjpeg's DCT scaling to 1/8 of each side), which
   still reads every entropy-coded byte and fails on truncated data, at about half the cost of a
   full decode (measured: 1.2 ms vs 1.9 ms for a 512² JPEG, 4.8 ms vs 10 ms at 1024²); other
   formats are decoded fully by ``mmidx.images.verify_decodable``.
3. With ``max_image_size`` set, an image whose long edge exceeds it is resized and re-encoded by
   ``mmidx.images.downsize_and_reencode`` (that full decode is the check of step 2), and the new
   bytes are probed again, so stored sizes always describe stored bytes.

Video (BAGEL's ``FrameSampler`` with decord, ``data/video_utils.py``): a view draws
n = randint(min_frames, max_frames) frames with :func:`frame_indices`, BAGEL's
``get_frame_indices(n, vlen, 'rand')``; frames are decoded with PyAV in decode order (frame ``i``
is the ``i``-th frame ``container.decode(video=0)`` yields), converted to RGB and stored as JPEG.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterable

import av
import numpy as np
import pyarrow.fs as pafs
from PIL import Image, ImageFile

from mmidx import images
from mmidx.builder import StoredImage
from mmidx.sources import Skipped, SourceContext, pil_pixel_limit
from mmidx.sources.inputs import filesystem, is_uri, read_bytes

_DRAFT_FORMATS = ("JPEG", "MPO")


def _check_decodes(data: bytes, info: images.ImageInfo, max_pixels: int) -> None:
    if info.format not in _DRAFT_FORMATS:
        images.verify_decodable(data, max_pixels=max_pixels)
        return
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True, so truncated images decode silently "
                           "padded and cannot be detected; set it to False before building")
    try:
        image = Image.open(io.BytesIO(data))
        image.draft(image.mode, (max(1, info.width // 8), max(1, info.height // 8)))
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError, IndexError) as error:
        raise images.ImageError(f"cannot decode {info.format} image of {info.width}x{info.height}: "
                                f"{error}") from error


def ingest_image(data: bytes, context: SourceContext) -> StoredImage:
    """Probe, check and (optionally) downsize encoded image bytes; raise :class:`Skipped` if unusable.

    The pixel limit is ``--max-image-pixels`` (default ``mmidx.images.DEFAULT_MAX_PIXELS``), checked
    here on the probed size; images beyond PIL's own limit are refused by PIL while probing.
    """
    max_size = context.options.max_image_size
    max_pixels = context.options.max_image_pixels or images.DEFAULT_MAX_PIXELS
    pil_limit = pil_pixel_limit()
    with context.timed("images"):
        try:
            info = images.probe(data, max_pixels=pil_limit)
            if info.width * info.height > max_pixels:
                raise Skipped("decompression_bomb", f"{info.format} image of {info.width}x{info.height} = "
                                                    f"{info.width * info.height} pixels, above {max_pixels}")
            if max_size and max(info.width, info.height) > max_size:
                data = images.downsize_and_reencode(data, max_size, max_pixels=pil_limit)
                info = images.probe(data, max_pixels=pil_limit)
            else:
                _check_decodes(data, info, pil_limit)
        except images.ImageError as error:
            bomb = isinstance(error.__cause__, Image.DecompressionBombError)
            raise Skipped("decompression_bomb" if bomb else "undecodable_image", str(error)) from error
    return StoredImage(data, info.width, info.height, info.format, info.mode, info.has_transparency)


def read_media_file(location: str) -> bytes:
    """The bytes of an image or video file named by a row; raise ``Skipped("missing_file")`` if absent."""
    try:
        return read_bytes(location)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as error:
        raise Skipped("missing_file", f"{location}: no such file") from error


def ingest_image_file(location: str, context: SourceContext) -> StoredImage:
    """:func:`ingest_image` of the file at ``location``; a skip names the file."""
    data = read_media_file(location)
    try:
        return ingest_image(data, context)
    except Skipped as skipped:
        raise Skipped(skipped.reason, f"{location}: {skipped.detail}") from skipped


# --------------------------------------------------------------------------- video


def frame_indices(rng, vlen: int, min_frames: int, max_frames: int) -> list[int]:
    """Frame numbers of one draw, as BAGEL's ``read_frames_decord`` + ``get_frame_indices(..., 'rand')``.

    n = randint(min_frames, max_frames); the video is split into min(n, vlen) intervals
    (``linspace(0, vlen, k + 1).astype(int)``) and one frame is drawn from ``range(a, b - 1)`` of each
    interval [a, b) — BAGEL's range stops one short of the interval's last frame. If an interval
    is too short for that, BAGEL falls back to a sorted random subset of k frames. Fewer than n
    frames (a short video) are padded with the last one, so a draw always has n entries. ``rng``
    is a ``random.Random``; it stands in for both ``random`` and ``np.random`` of BAGEL.
    """
    count = rng.randint(min_frames, max_frames)
    intervals = np.linspace(start=0, stop=vlen, num=min(count, vlen) + 1).astype(int).tolist()
    try:
        chosen = [rng.choice(range(low, high - 1)) for low, high in itertools.pairwise(intervals)]
    except IndexError:  # BAGEL's fallback for intervals of one or two frames
        chosen = sorted(rng.sample(range(vlen), min(count, vlen)))
    return chosen + chosen[-1:] * (count - len(chosen))


class VideoFile:
    """A video named by a row, opened with PyAV; a failure to open or decode skips the row."""

    def __init__(self, location: str, context: SourceContext):
        self.location = location
        self.context = context
        fs, path = filesystem(location)
        if fs.get_file_info(path).type != pafs.FileType.File:
            raise Skipped("missing_file", f"{location}: no such file")
        self._source = location if not is_uri(location) else io.BytesIO(read_media_file(location))

    def _open(self) -> av.container.InputContainer:
        if isinstance(self._source, io.BytesIO):
            self._source.seek(0)
        try:
            return av.open(self._source)
        except av.FFmpegError as error:
            raise Skipped("undecodable_video", f"{self.location}: {error}") from error

    def frame_count(self) -> int:
        """Frames in the first video stream: the container's count, or the packets when it has none."""
        with self.context.timed("video"), self._open() as container:
            if not container.streams.video:
                raise Skipped("undecodable_video", f"{self.location}: no video stream")
            stream = container.streams.video[0]
            if stream.frames:
                return stream.frames
            return sum(1 for packet in container.demux(stream) if packet.size)

    def frames(self, wanted: Iterable[int]) -> dict[int, StoredImage]:
        """The frames numbered ``wanted`` (decode order), as ingested JPEG images."""
        wanted = set(wanted)
        found: dict[int, StoredImage] = {}
        last = max(wanted, default=-1)
        with self.context.timed("video"), self._open() as container:
            try:
                for number, frame in enumerate(container.decode(video=0)):
                    if number in wanted:
                        output = io.BytesIO()
                        frame.to_image().save(output, format="JPEG", quality=self.context.options.frame_quality)
                        found[number] = output.getvalue()
                    if number >= last:
                        break
            except av.FFmpegError as error:
                raise Skipped("undecodable_video", f"{self.location}: {error}") from error
        if len(found) < len(wanted):
            raise Skipped("undecodable_video", f"{self.location}: decoding ended before frame "
                                               f"{min(wanted - set(found))}; the container says otherwise")
        return {number: ingest_image(data, self.context) for number, data in found.items()}
