"""Images and video frames at build time: the one place where media are checked, capped and stored.

Every image a source stores passes :func:`ingest_image`:

1. ``mmidx.images.decode.open_image`` reads the header only (width, height, format, mode, transparency);
   images above ``max_image_pixels`` (decompression bombs) are refused before any pixel is decoded.
2. The image must decode as the loader decodes it, so that a truncated or corrupt file fails here and not in
   a training job: ``mmidx.images.decode.check_decodes`` on the image opened in step 1 (its header is parsed
   once). YCbCr and greyscale JPEGs are decoded by simplejpeg in strict mode (libjpeg-turbo, as the reader's
   ``decode_rgb_pixels``) scaled to 1/8 of each side and to luma only, which refuses what the full decode
   refuses (PIL's decoder passes corrupt entropy data and junk before the end marker silently). Measured on
   the download benchmark's JPEGs: 0.26 ms against 0.36 ms in PIL's draft mode (same scaling) and 0.49 ms for
   a full decode.
3. With ``max_image_size`` set, an image whose long edge exceeds it is resized and re-encoded by
   ``mmidx.images.decode.downsize_and_reencode`` (that full decode is the check of step 2), and the new
   bytes are probed again, so stored sizes always describe stored bytes.

Video (BAGEL's ``FrameSampler`` with decord, ``data/video_utils.py``): a view draws
n = randint(min_frames, max_frames) frames with :func:`frame_indices`, BAGEL's
``get_frame_indices(n, vlen, sample)`` for ``sample`` = ``rand``, ``middle`` (optionally with
``fix_start``) or ``fpsX``; frames are decoded with PyAV in decode order (frame ``i`` is the ``i``-th
frame ``container.decode(video=0)`` yields), converted to RGB and stored losslessly as WebP at
its fastest effort (``benchmarks/bench_frames.py``: 25–40% smaller than PNG and 3–5× faster to
encode, decoding between 0.6× and 1.4× PNG's time), or as JPEG when ``frame_quality`` is set. A name
ending in ``/`` is a folder of frame images (BAGEL's ``read_frames_folder``), stored as they are.
"""

from __future__ import annotations

import io
import itertools
import posixpath
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import av
import numpy as np
import pyarrow.fs as pafs
from PIL import Image

from mmidx.images import decode as images
from mmidx.sources import Skipped, SourceContext, SourceOptions, pil_pixel_limit
from mmidx.sources.elements import StoredImage
from mmidx.sources.inputs import filesystem, is_uri, read_bytes, resolve


def ingest_image(data: bytes, context: SourceContext) -> StoredImage:
    """Probe, check and (optionally) downsize encoded image bytes; raise :class:`Skipped` if unusable.

    The pixel limit is ``--max-image-pixels`` (default ``mmidx.images.decode.DEFAULT_MAX_PIXELS``), checked
    here on the probed size; images beyond PIL's own limit are refused by PIL while probing.
    """
    max_size = context.options.max_image_size
    max_pixels = context.options.max_image_pixels or images.DEFAULT_MAX_PIXELS
    pil_limit = pil_pixel_limit()
    with context.timed("images"):
        try:
            image, info = images.open_image(data, max_pixels=pil_limit)
            if info.width * info.height > max_pixels:
                raise Skipped("decompression_bomb", f"{info.format} image of {info.width}x{info.height} = "
                                                    f"{info.width * info.height:,} pixels, above --max-image-pixels "
                                                    f"{max_pixels:,}")
            if max_size and max(info.width, info.height) > max_size:
                data = images.downsize_and_reencode(data, max_size, max_pixels=pil_limit)
                info = images.probe(data, max_pixels=pil_limit)
            else:
                images.check_decodes(image, data, info)
        except images.ImageError as error:
            if isinstance(error.__cause__, Image.DecompressionBombError):  # above PIL's limit, so above ours
                pixels = re.search(r"\((\d+) pixels\)", str(error.__cause__))
                size = f"image of {int(pixels[1]):,} pixels" if pixels else "image"
                raise Skipped("decompression_bomb", f"{size}, above --max-image-pixels {max_pixels:,}") from error
            raise Skipped("undecodable_image", str(error)) from error
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

_WEBP_MAX_SIDE = 16383
FRAME_SAMPLER_KEYS = ("min_num_frames", "max_num_frames", "sample", "fix_start")


def frame_sampler_options(options: SourceOptions, frame_sampler_args: Mapping[str, Any]) -> SourceOptions:
    """``options`` with a BAGEL group's ``frame_sampler_args`` applied; unknown keys are refused.

    ``min_num_frames``/``max_num_frames``/``sample`` are BAGEL's ``FrameSampler`` arguments;
    ``fix_start`` is ``get_frame_indices``'s (BAGEL's sampler never passes it): with ``middle``,
    frame = interval start + fix_start.
    """
    unknown = sorted(set(frame_sampler_args) - set(FRAME_SAMPLER_KEYS))
    if unknown:
        raise ValueError(f"frame_sampler_args: unknown keys {unknown}; the known ones are "
                         f"{', '.join(FRAME_SAMPLER_KEYS)}")
    args = frame_sampler_args
    return replace(options, min_frames=args.get("min_num_frames", options.min_frames),
                   max_frames=args.get("max_num_frames", options.max_frames),
                   frame_sample=args.get("sample", options.frame_sample),
                   frame_fix_start=args.get("fix_start", options.frame_fix_start))


def sampled_frames(rng, count: int, vlen: int, sample: str, fix_start: int | None = None,
                   fps: float = 1.0) -> list[int]:
    """BAGEL's ``get_frame_indices(count, vlen, sample, fix_start, input_fps=fps)``.

    ``rand``/``middle``: the video is cut into k = min(count, vlen) intervals at
    ``linspace(0, vlen, k + 1).astype(int)``; of each interval [a, b), ``rand`` draws from
    ``range(a, b - 1)`` (BAGEL stops one short of the last frame; intervals too short for that make
    it fall back to a sorted random subset of k frames), ``middle`` takes (a + b - 1) // 2, and
    ``middle`` with ``fix_start`` takes a + fix_start. Fewer than ``count`` frames are padded with the
    last. ``fpsX``: one frame every 1/X s at the middle of its slot, ``round((j + 1/2) / X · fps)``,
    while below vlen (no count, no padding). ``rng`` is a ``random.Random`` standing in for BAGEL's
    ``random`` and ``np.random``.
    """
    if sample.startswith("fps"):
        delta = 1 / float(sample[3:])
        seconds = np.arange(delta / 2, vlen / fps + delta / 2, delta)
        return [int(i) for i in np.around(seconds * fps).astype(int) if i < vlen]
    intervals = np.linspace(start=0, stop=vlen, num=min(count, vlen) + 1).astype(int).tolist()
    if sample == "rand":
        try:
            chosen = [rng.choice(range(low, high - 1)) for low, high in itertools.pairwise(intervals)]
        except IndexError:  # BAGEL's fallback for intervals of one or two frames
            chosen = sorted(rng.sample(range(vlen), min(count, vlen)))
    elif fix_start is not None:
        chosen = [low + fix_start for low in intervals[:-1]]
    else:
        chosen = [(low + high - 1) // 2 for low, high in itertools.pairwise(intervals)]
    return chosen + chosen[-1:] * (count - len(chosen))


def frame_indices(rng, vlen: int, options: SourceOptions, *, fps: float = 1.0, folder: bool = False) -> list[int]:
    """The frame numbers of one draw, as BAGEL's ``FrameSampler`` picks them.

    n = randint(min_frames, max_frames) is drawn first (in every mode, as BAGEL does), then
    :func:`sampled_frames`. A frame folder (BAGEL's ``read_frames_folder``) samples only when it
    holds more than n frames, with fps = 1, and otherwise gives all its frames.
    """
    count = rng.randint(options.min_frames, options.max_frames)
    if folder and vlen <= count:
        return list(range(vlen))
    return sampled_frames(rng, count, vlen, options.frame_sample, options.frame_fix_start, fps)


def _frame_number(name: str) -> int:
    """BAGEL's ``extract_frame_number``: the number in ``..._<n>.jpg``, else -1."""
    match = re.search(r"_(\d+).jpg$", name)
    return int(match.group(1)) if match else -1


class FrameFolder:
    """A video given as a folder of frame images (a name ending in ``/``), in BAGEL's frame order:
    by the number in ``name_<n>.jpg`` (others first), then by name. Frames are stored as they are."""

    def __init__(self, location: str, context: SourceContext):
        self.location = location
        self.context = context
        fs, path = filesystem(location)
        if fs.get_file_info(path).type != pafs.FileType.Directory:
            raise Skipped("missing_file", f"{location}: no such folder")
        names = [posixpath.basename(entry.path) for entry in fs.get_file_info(pafs.FileSelector(path))
                 if entry.type == pafs.FileType.File]
        self.names = sorted(names, key=lambda name: (_frame_number(name), name))

    def frame_count(self) -> int:
        return len(self.names)

    def fps(self) -> float:
        """BAGEL samples frame folders with ``input_fps`` 1."""
        return 1.0

    def frames(self, wanted: Iterable[int]) -> dict[int, StoredImage]:
        """The frames numbered ``wanted`` (positions in frame order), ingested as stored images."""
        return {number: ingest_image_file(resolve(self.location, self.names[number]), self.context)
                for number in wanted}


class VideoFile:
    """A video named by a row, opened with PyAV; a failure to open or decode skips the row.

    Frames are stored losslessly (they decode to exactly PyAV's RGB frame) as WebP at its fastest
    effort, or PNG past WebP's 16383-pixel side limit; as JPEG of ``frame_quality`` when that option
    is set (smaller, lossy).
    """

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

    def _stream(self, container: av.container.InputContainer) -> av.video.stream.VideoStream:
        if not container.streams.video:
            raise Skipped("undecodable_video", f"{self.location}: no video stream")
        return container.streams.video[0]

    def frame_count(self) -> int:
        """Frames in the first video stream: the container's count, or the packets when it has none."""
        with self.context.timed("video"), self._open() as container:
            stream = self._stream(container)
            if stream.frames:
                return stream.frames
            return sum(1 for packet in container.demux(stream) if packet.size)

    def fps(self) -> float:
        """The stream's average frame rate (decord's ``get_avg_fps``), which ``fpsX`` sampling reads."""
        with self._open() as container:
            rate = self._stream(container).average_rate
        if not rate:
            raise Skipped("undecodable_video", f"{self.location}: no frame rate, which fps sampling needs")
        return float(rate)

    def frames(self, wanted: Iterable[int]) -> dict[int, StoredImage]:
        """The frames numbered ``wanted`` (decode order), as ingested images."""
        wanted = set(wanted)
        found: dict[int, bytes] = {}
        last = max(wanted, default=-1)
        quality = self.context.options.frame_quality
        with self.context.timed("video"), self._open() as container:
            try:
                for number, frame in enumerate(container.decode(video=0)):
                    if number in wanted:
                        output = io.BytesIO()
                        image = frame.to_image()
                        if quality is not None:
                            image.save(output, format="JPEG", quality=quality)
                        elif max(image.size) <= _WEBP_MAX_SIDE:
                            image.save(output, format="WEBP", lossless=True, method=0, quality=0)
                        else:
                            image.save(output, format="PNG")
                        found[number] = output.getvalue()
                    if number >= last:
                        break
            except av.FFmpegError as error:
                raise Skipped("undecodable_video", f"{self.location}: {error}") from error
        if len(found) < len(wanted):
            raise Skipped("undecodable_video", f"{self.location}: decoding ended before frame "
                                               f"{min(wanted - set(found))}; the container says otherwise")
        return {number: ingest_image(data, self.context) for number, data in found.items()}


def sample_video(name: object, root: str, rng: random.Random,
                 context: SourceContext) -> tuple[VideoFile | FrameFolder, list[list[int]]]:
    """The video a row names (a file, or a frame folder when ``name`` ends in ``/``, relative to ``root``)
    and one draw of :func:`frame_indices` from ``rng`` per view (``options.views`` draws).

    A name that is not a string, a video without frames, or a draw with no frame or frames past the
    end (``fix_start`` too large; BAGEL's frame read fails there) raises :class:`Skipped`.
    """
    if not isinstance(name, str):
        raise Skipped("malformed_record", f"video is not a file name: {str(name)[:80]!r}")
    folder = name.endswith("/")
    location = resolve(root, name)
    video = FrameFolder(location, context) if folder else VideoFile(location, context)
    count = video.frame_count()
    if count == 0:
        raise Skipped("undecodable_video", f"{video.location}: no frames")
    options = context.options
    fps = video.fps() if options.frame_sample.startswith("fps") else 1.0
    draws = [frame_indices(rng, count, options, fps=fps, folder=folder) for _ in range(options.views)]
    unusable = next((draw for draw in draws if not draw or max(draw) >= count), None)
    if unusable is not None:
        raise Skipped("undecodable_video", f"{video.location}: sampling {options.frame_sample!r} gives frames "
                                           f"{unusable} of {count}")
    return video, draws
