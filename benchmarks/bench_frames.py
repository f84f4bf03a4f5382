"""How to store decoded video frames: PNG vs lossless WebP (vs the lossy JPEG mmidx stored before).

A photo-like clip (smooth colour fields, shapes, mild noise, panning) is encoded with H.264, decoded
with PyAV as ``mmidx build`` does, and every frame is stored each way. Printed per frame: stored
bytes, encode time (paid once at build) and decode time (paid by the loader every epoch), and the
largest pixel difference from the decoded frame (0 = lossless).

    python benchmarks/bench_frames.py [--frames 24] [--size 512x384]
"""

from __future__ import annotations

import argparse
import io
import random
import tempfile
from pathlib import Path

import av
import numpy as np
from common import Watch, best_of, machine
from PIL import Image

from mmidx.toolkit.synthetic import photo_jpeg

FORMATS = {
    "PNG (Pillow default, level 6)": {"format": "PNG"},
    "PNG level 1": {"format": "PNG", "compress_level": 1},
    "WebP lossless, method 0 (mmidx)": {"format": "WEBP", "lossless": True, "method": 0, "quality": 0},
    "WebP lossless, Pillow default effort": {"format": "WEBP", "lossless": True},
    "JPEG quality 95 (lossy, before)": {"format": "JPEG", "quality": 95},
}


def clip(path: Path, frames: int, width: int, height: int) -> list[Image.Image]:
    """Write a panning photo-like H.264 clip and return its frames as PyAV decodes them."""
    scene = Image.open(io.BytesIO(photo_jpeg(random.Random(0), width * 2, height, 95))).convert("RGB")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            view = scene.crop((index * 8, 0, index * 8 + width, height))
            container.mux(stream.encode(av.VideoFrame.from_image(view)))
        container.mux(stream.encode())
    with av.open(str(path)) as container:
        return [frame.to_image() for frame in container.decode(video=0)]


def encoded(image: Image.Image, options: dict) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, **options)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--size", default="512x384")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory() as folder:
        frames = clip(Path(folder, "clip.mp4"), args.frames, width, height)
    print(f"{machine('Pillow', 'av')}; {len(frames)} frames of {width}x{height}, raw RGB "
          f"{width * height * 3 / 1024:.0f} KiB each\n")
    print("| stored as | KiB / frame | encode ms / frame | decode ms / frame | max pixel error |")
    print("|---|---:|---:|---:|---:|")
    with Watch() as watch:
        for name, options in FORMATS.items():
            encode_s, data = best_of(lambda options=options: [encoded(frame, options) for frame in frames], 3)
            decode_s, decoded = best_of(lambda data=data: [np.asarray(Image.open(io.BytesIO(d)).convert("RGB"))
                                                           for d in data], 3)
            error = max(int(np.abs(np.asarray(f, dtype=np.int16) - d).max())
                        for f, d in zip(frames, decoded, strict=True))
            print(f"| {name} | {sum(map(len, data)) / len(frames) / 1024:.1f} | {encode_s / len(frames) * 1e3:.1f} | "
                  f"{decode_s / len(frames) * 1e3:.2f} | {error} |")

    print(f"\n{watch.describe()}")

if __name__ == "__main__":
    main()
