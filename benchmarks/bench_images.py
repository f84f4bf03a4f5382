"""Speed of mmidx.images on a 512² JPEG, JPEG decoders compared, and token counting over many sizes.

    python benchmarks/bench_images.py [--bagel-site DIR [--bagel-src DIR]] [--repeats N]

Prints Markdown tables (best of N runs, as timeit does, since shared cores only add noise; one
thread). The reference of the to-tensor rows is PIL's bicubic ``resize`` + torchvision's ``ToTensor`` and
``Normalize``: the real ones (checked equal to mmidx's output) when torchvision imports, e.g. from ``--bagel-site``
(BAGEL's extra packages for a CPU torch, see bagel_peer.py); otherwise a transcription of their documented steps,
and the table says which. With ``--bagel-src`` (a checkout of ByteDance-Seed/Bagel, ``--bagel-repo`` before) it
times BAGEL's own ``pil_img2rgb``/``ImageTransform``/``patchify`` beside mmidx's and checks the outputs are equal.

Decoders: PIL's libjpeg-turbo (what mmidx and BAGEL use) against ``simplejpeg`` and
``PyTurboJPEG`` (the system's libturbojpeg), each where installed, on the same bytes: time per
decode to RGB and whether every pixel equals PIL's, over JPEGs of several subsamplings, qualities
and odd sizes. ``pip install simplejpeg PyTurboJPEG`` (and ``apt-get install libturbojpeg0``) to
include them; mmidx would adopt one only if its pixels were identical and it were faster.
"""

from __future__ import annotations

import argparse
import io
import statistics
import types
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import numpy as np
import torch
from bagel_peer import add_bagel_site, import_bagel
from common import Watch, best_of, interleave, machine
from PIL import Image

from mmidx.images.decode import decode_rgb, probe, rgb_pixels
from mmidx.images.patches import patchify
from mmidx.images.transform import BAGEL_VAE_TRANSFORM, BAGEL_VIT_TRANSFORM, num_image_tokens, resize_shape


def photo_like_jpeg(size: int = 512, quality: int = 90) -> bytes:
    """A smooth image with texture, closer to a photo's JPEG size and decode cost than pure noise."""
    y, x = np.mgrid[0:size, 0:size] / size
    rng = np.random.default_rng(0)
    pixels = np.stack([np.sin(6 * x + 2 * y), np.cos(5 * y - 3 * x), np.sin(9 * x * y)], axis=-1) * 100 + 128
    pixels += rng.normal(0, 12, pixels.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()




def test_jpegs() -> dict[str, bytes]:
    """JPEGs covering what decoders may treat differently: chroma subsampling, quality, odd sizes, grey."""
    photo = decode_rgb(photo_like_jpeg(1024))
    jpegs = {"512² q90 4:2:0": photo_like_jpeg()}
    for name, image, options in [
        ("1024² q95 4:4:4", photo, {"quality": 95, "subsampling": 0}),
        ("1023×767 q75 4:2:2", photo.crop((0, 0, 1023, 767)), {"quality": 75, "subsampling": 1}),
        ("333×517 q85 4:2:0", photo.crop((5, 7, 338, 524)), {"quality": 85, "subsampling": 2}),
        ("grey 640×480", photo.convert("L").crop((0, 0, 640, 480)), {"quality": 90}),
    ]:
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", **options)
        jpegs[name] = buffer.getvalue()
    return jpegs


def jpeg_decoders() -> dict[str, Callable[[bytes], np.ndarray]]:
    """Decoders to RGB (H, W, 3) uint8 arrays: PIL as mmidx decodes, and the optional libraries installed."""
    decoders: dict[str, Callable[[bytes], np.ndarray]] = {
        "PIL (libjpeg-turbo), zero-copy view": lambda data: rgb_pixels(decode_rgb(data))}
    try:
        import simplejpeg

        decoders[f"simplejpeg {simplejpeg.__version__}"] = lambda data: simplejpeg.decode_jpeg(data, colorspace="RGB")
    except ImportError:
        pass
    try:
        from turbojpeg import TJPF_RGB, TurboJPEG

        turbo = TurboJPEG()
        decoders[f"PyTurboJPEG {version('PyTurboJPEG')} (system libturbojpeg)"] = \
            lambda data: turbo.decode(data, pixel_format=TJPF_RGB)
    except (ImportError, RuntimeError, OSError):  # not installed, or no libturbojpeg
        pass
    return decoders


def compare_decoders(repeats: int) -> list[tuple[str, float, str]]:
    """(decoder, ms per decode of the 512² JPEG, how many test JPEGs decode to exactly PIL's pixels)."""
    jpegs = test_jpegs()
    decoders = jpeg_decoders()
    pil = next(iter(decoders.values()))
    reference = {name: pil(data) for name, data in jpegs.items()}
    rows = []
    for decoder_name, decode in decoders.items():
        equal = [name for name, data in jpegs.items() if np.array_equal(decode(data), reference[name])]
        differ = sorted(set(jpegs) - set(equal))
        verdict = f"{len(equal)}/{len(jpegs)}" + (f" (differs: {', '.join(differ)})" if differ else "")
        elapsed = best_of(lambda decode=decode: decode(jpegs["512² q90 4:2:0"]), repeats, warmup=True)[0]
        rows.append((decoder_name, elapsed * 1e3, verdict))
    return rows


def transcribed_steps(image: Image.Image) -> torch.Tensor:
    """A transcription of torchvision's documented ToTensor + Normalize(0.5, 0.5), for when it cannot be imported."""
    tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous().to(torch.float32).div(255)
    return tensor.sub_(0.5).div_(0.5)


def to_tensor_reference() -> tuple[str, Callable[[Image.Image], torch.Tensor]]:
    """torchvision's own ToTensor + Normalize(0.5, 0.5) where it imports, else the transcription; and its label."""
    try:
        from torchvision import __version__
        from torchvision.transforms import Compose, Normalize, ToTensor
    except (ImportError, RuntimeError):  # not installed, or its compiled operators refuse this torch
        return "a transcription of torchvision's ToTensor/Normalize steps (torchvision not importable)", \
            transcribed_steps
    return f"torchvision {__version__} ToTensor/Normalize", Compose([ToTensor(), Normalize([0.5] * 3, [0.5] * 3)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bagel-src", "--bagel-repo", dest="bagel_src",
                        help="BAGEL checkout to time side by side (needs torchvision: --bagel-site)")
    parser.add_argument("--bagel-site", help="folder with torchvision (and BAGEL's other extras) for a CPU torch")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with Watch() as watch:
        data = photo_like_jpeg()
        image = decode_rgb(data)
        resized = image.resize(BAGEL_VIT_TRANSFORM.output_size(image), Image.Resampling.BICUBIC)
        vit_tensor = BAGEL_VIT_TRANSFORM(image)
        rows: list[tuple[str, float, float | None]] = []
        add_bagel_site(args.bagel_site)
        reference_name, reference = to_tensor_reference()
        bagel = None
        if args.bagel_src:
            try:
                import_bagel(args.bagel_src, args.bagel_site)
            except ImportError as error:
                parser.error(f"BAGEL's data package does not import ({error}); pass --bagel-site with its extras")
            from data import data_utils, transforms  # BAGEL's own, unmodified

            bagel = types.SimpleNamespace(transforms=transforms, data_utils=data_utils)
        bagel_vit = bagel and bagel.transforms.ImageTransform(518, 224, 14)
        bagel_vae = bagel and bagel.transforms.ImageTransform(1024, 512, 16)

        def row(name: str, ours: Callable[[], Any], theirs: Callable[[], Any] | None = None) -> None:
            """Median CPU seconds of each side, the two taking turns call by call (common.interleave)."""
            sides = {"mmidx": ours, **({"reference": theirs} if theirs else {})}
            for side in sides.values():
                side()  # warm up
            turns = interleave({key: (lambda _, side=side: side()) for key, side in sides.items()},
                               range(args.repeats), rounds=1)
            median = {key: statistics.median(turns.cpu[key][0]) for key in sides}
            rows.append((name, median["mmidx"], median.get("reference")))

        def bagel_decode() -> Image.Image:
            return bagel.data_utils.pil_img2rgb(Image.open(io.BytesIO(data)))

        row("probe (header only)", lambda: probe(data))
        row("decode to RGB (open + to_rgb)", lambda: decode_rgb(data), bagel and bagel_decode)
        row("to tensor, 512² (reference: ToTensor/Normalize)", lambda: BAGEL_VAE_TRANSFORM.to_tensor(image),
            lambda: reference(image))
        row("resize 512² → 518² + to tensor (fused; reference: PIL bicubic, ToTensor/Normalize)",
            lambda: BAGEL_VIT_TRANSFORM.to_tensor(image, resized.size),
            lambda: reference(image.resize(resized.size, Image.Resampling.BICUBIC)))
        assert torch.equal(BAGEL_VIT_TRANSFORM.to_tensor(image, resized.size), reference(resized))
        assert torch.equal(BAGEL_VAE_TRANSFORM.to_tensor(image), reference(image))
        assert torch.equal(reference(resized), transcribed_steps(resized))
        row("ViT transform 512² → 518² tensor", lambda: BAGEL_VIT_TRANSFORM(image),
            bagel and (lambda: bagel_vit(image)))
        row("VAE transform 512² → 512² tensor", lambda: BAGEL_VAE_TRANSFORM(image),
            bagel and (lambda: bagel_vae(image)))
        row("patchify 518², p=14", lambda: patchify(vit_tensor, 14),
            bagel and (lambda: bagel.data_utils.patchify(vit_tensor, 14)))
        row("decode + ViT transform + patchify", lambda: patchify(BAGEL_VIT_TRANSFORM(decode_rgb(data)), 14),
            bagel and (lambda: bagel.data_utils.patchify(bagel_vit(bagel_decode()), 14)))
        if bagel:
            assert torch.equal(BAGEL_VIT_TRANSFORM(decode_rgb(data)), bagel_vit(bagel_decode()))
            assert torch.equal(BAGEL_VAE_TRANSFORM(decode_rgb(data)), bagel_vae(bagel_decode()))

        rng = np.random.default_rng(0)
        widths, heights = rng.integers(64, 4096, 1_000_000), rng.integers(64, 4096, 1_000_000)
        vectorised = best_of(lambda: num_image_tokens(widths, heights, BAGEL_VIT_TRANSFORM), 5, warmup=True)[0]
        sample = list(zip(widths[:20_000].tolist(), heights[:20_000].tolist(), strict=True))
        kwargs = {"max_size": 518, "min_size": 224, "stride": 14, "max_pixels": BAGEL_VIT_TRANSFORM.max_pixels}
        scalar = best_of(lambda: [resize_shape(w, h, **kwargs) for w, h in sample], 3, warmup=True)[0]
        scalar = scalar / len(sample) * 1e6

        decoders = compare_decoders(args.repeats)
    print(f"{len(data)}-byte 512² JPEG, one thread; {machine('Pillow', 'numpy', 'torch')}; medians of "
          f"{args.repeats} calls a side, the sides taking turns (CPU time)")
    print(f"ToTensor/Normalize reference: {reference_name}; outputs checked equal to mmidx's\n")
    print("| step | mmidx (ms) | reference (ms) |\n|---|---:|---:|")
    for name, ours, theirs in rows:
        print(f"| {name} | {ours * 1e3:.2f} | {'' if theirs is None else f'{theirs * 1e3:.2f}'} |")
    print(f"\nnum_image_tokens, 1M probed sizes (ViT preset): {vectorised * 1e3:.0f} ms "
          f"({vectorised:.3f} µs per image); scalar resize_shape: {scalar:.1f} µs per image")
    if bagel:
        print("\nReference column: BAGEL's own code where one exists; transform outputs checked bit-equal.")
    print("\n| JPEG decoder | ms per 512² decode to RGB | pixels equal to PIL's |\n|---|---:|---|")
    for name, milliseconds, verdict in decoders:
        print(f"| {name} | {milliseconds:.2f} | {verdict} |")
    print(f"\n{watch.describe()}")


if __name__ == "__main__":
    main()
