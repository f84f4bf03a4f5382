"""Running a frozen encoder over a dataset: the job (``Job``), the units of work (images grouped by output
shape, or text sequences: ``plan_units``), and one batch encoded (``encode_batch``), shared by the local
and the Ray engines of :mod:`mmidx.encodings.precache`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.images.decode import ImageError, decode_rgb_pixels
from mmidx.images.transform import ImageTransform
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.encoding_streams import DTYPES

RECORD_SIZE = fmt.ENCODING_RECORD.itemsize


@dataclasses.dataclass(frozen=True)
class Job:
    """What one precache computes: the options that decide its bytes."""

    name: str
    encoder: str  # "pkg.module:factory"
    modality: str = "image"  # image | text
    transform: str = "vae"  # vae | vit: which of the group's transforms (and element kind) feeds the encoder
    store: str = "moments"  # moments | mean | sample (a single-tensor output is stored as is)
    dtype: str = "bf16"
    batch_size: int = 16
    weights_version: str | None = None

    def __post_init__(self) -> None:
        if self.modality not in ("image", "text") or self.transform not in ("vae", "vit") or \
                self.store not in ("moments", "mean", "sample") or self.dtype not in DTYPES or self.batch_size < 1:
            raise ValueError(f"bad precache options {self}: modality image|text, transform vae|vit, "
                             "store moments|mean|sample, dtype bf16|fp16|fp32, batch size >= 1")
        fmt.encoding_path("p", self.name, "json")  # the name check


@dataclasses.dataclass
class RunOptions:
    """How a precache runs (nothing here changes its bytes): where, on how many threads or Ray workers."""

    device: str = "cpu"
    workers: int = 1  # local: threads decoding and transforming; ray: encoder actors
    progress: bool = True
    engine: str = "local"  # local | ray
    ray_address: str | None = None
    encoder: Callable[..., Any] | None = None  # an encoder already loaded (local engine only)


def encoder_factory(spec: str) -> Callable[[], Any]:
    """The ``factory`` that ``pkg.module:factory`` names, imported (a ValueError saying what is wrong if not)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--encoder {spec!r}: give it as pkg.module:factory")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--encoder {spec!r}: cannot import it ({error}); is its package on PYTHONPATH?") from error


def load_encoder(spec: str, device: str = "cpu") -> Callable[..., Any]:
    """``factory()`` of ``pkg.module:factory``, on ``device`` and in eval mode when it is a module."""
    encoder = encoder_factory(spec)()
    if isinstance(encoder, torch.nn.Module):
        encoder.eval().requires_grad_(False).to(device)
    return encoder


def _outputs(result: Any, store: str, items: np.ndarray, img_nums: np.ndarray) -> tuple[torch.Tensor, str]:
    """The (B, ...) values to store and the store name recorded: moments stack (mean, logvar) on dim 1."""
    if isinstance(result, torch.Tensor):
        return result, "tensor"
    if isinstance(result, (tuple, list)) and len(result) == 2:
        mean, logvar = result
    elif hasattr(result, "mean") and hasattr(result, "logvar"):  # e.g. a diagonal Gaussian posterior
        mean, logvar = result.mean, result.logvar
    else:
        raise ValueError("the encoder returned neither a tensor, nor (mean, logvar), nor an object with .mean "
                         f"and .logvar, but {type(result).__name__}")
    if store == "moments":
        return torch.stack([mean, logvar], dim=1), store
    if store == "mean":
        return mean, store
    noise = torch.stack([torch.from_numpy(record_noise(int(item), int(img_num), tuple(mean.shape[1:])))
                         for item, img_num in zip(items, img_nums, strict=True)]).to(mean.device)
    return mean + torch.exp(0.5 * logvar.float()) * noise, store


def record_noise(item: int, img_num: int, shape: tuple[int, ...]) -> np.ndarray:
    """The normal draw of ``--store sample`` for one record: a pure function of (item, img_num)."""
    generator = np.random.Generator(np.random.Philox(key=item, counter=[0, 2, img_num, 0]))
    return generator.standard_normal(shape, dtype=np.float32)


@dataclasses.dataclass
class Units:
    """The records to compute, in the order their batches run: item, img_num, and batch boundaries."""

    items: np.ndarray
    img_nums: np.ndarray
    shapes: np.ndarray  # (n, 2): output (height, width) of an image, (length, 0) of a text
    bounds: list[int]  # batch b is units bounds[b]:bounds[b + 1]


def plan_units(dataset: MMIDXDataset, job: Job, transform: ImageTransform | None) -> Units:
    """Distinct (image, img_num) of the job's element kind, or text sequences, batched by identical shape."""
    dataset.check_structure()
    plan = dataset.plan
    samples = dataset.element_samples()
    if job.modality == "text":
        documents = np.asarray(dataset.tokens.document_indices, dtype=np.int64)
        if plan is None:
            items = np.arange(int(documents[-1]), dtype=np.int64)
        else:
            texts = plan["elements"]["kind"] == fmt.TEXT
            items = np.unique(documents[samples[texts]] + plan["elements"]["payload"][texts])
        img_nums = np.zeros(len(items), dtype=np.int64)
        lengths = np.asarray(dataset.tokens.sequence_lengths, dtype=np.int64)[items]
        shapes = np.stack([lengths, np.zeros_like(lengths)], axis=1)
    else:
        if plan is None:
            raise ValueError(f"{dataset.prefix} is a text dataset: it has no images to precache")
        if transform is None:
            raise ValueError(f"{dataset.prefix}: no {job.transform} image transform in the config")
        kind = fmt.VAE_IMAGE if job.transform == "vae" else fmt.VIT_IMAGE
        chosen = plan["elements"]["kind"] == kind
        images = plan["sample_image_offsets"][samples[chosen]] + plan["elements"]["payload"][chosen]
        pairs = np.unique(np.stack([images, plan["elements"]["img_num"][chosen].astype(np.int64)], axis=1), axis=0)
        pairs = pairs.reshape(-1, 2)
        items, img_nums = pairs[:, 0], pairs[:, 1]
        info = plan["image_info"][items]
        widths, heights = transform.output_shapes(info["width"], info["height"], img_nums)
        shapes = np.stack([np.asarray(heights, np.int64), np.asarray(widths, np.int64)], axis=1).reshape(-1, 2)
    order = np.lexsort((img_nums, items, shapes[:, 1], shapes[:, 0]))
    items, img_nums, shapes = items[order], img_nums[order], shapes[order]
    bounds = [0]
    for start in [*np.flatnonzero(np.any(np.diff(shapes, axis=0) != 0, axis=1)).tolist(), len(items) - 1]:
        end = start + 1
        while bounds[-1] < end:
            bounds.append(min(end, bounds[-1] + job.batch_size))
    return Units(items, img_nums, shapes, bounds)


def encode_batch(dataset: MMIDXDataset, job: Job, transform: ImageTransform | None, units: Units, b: int,
                 encoder: Callable[..., Any], device: str,
                 pool: ThreadPoolExecutor | None = None) -> tuple[torch.Tensor, str]:
    """Batch ``b``'s values on the CPU in the stored dtype, and the store its output type gives."""
    start, end = units.bounds[b], units.bounds[b + 1]
    inputs = _inputs(dataset, job, transform, units, start, end, pool)
    with torch.inference_mode():
        result = encoder(inputs.to(device))
        values, store = _outputs(result, job.store, units.items[start:end], units.img_nums[start:end])
        values = values.to("cpu", DTYPES[job.dtype])
        if job.modality == "image" and job.transform == "vit" and values.dim() == 4:
            values = values.permute(0, 2, 3, 1)  # token-major (h, w, D): packs copy rows, no transpose
        return values, store


def _inputs(dataset: MMIDXDataset, job: Job, transform: ImageTransform | None, units: Units, start: int, end: int,
            pool: ThreadPoolExecutor | None) -> torch.Tensor:
    """The encoder's input of one batch: (B, 3, H, W) pixels exactly as packs make them, or (B, L) token ids."""
    if job.modality == "text":
        return torch.stack([torch.from_numpy(dataset.get_tokens(int(item)).astype(np.int64))
                            for item in units.items[start:end]])
    height, width = (int(n) for n in units.shapes[start])
    batch = torch.empty(end - start, 3, height, width, dtype=torch.float32)
    table = dataset.plan["image_info"]
    offsets = dataset.plan["image_offsets"]

    def render(slot: int) -> None:
        item = int(units.items[start + slot])
        data = dataset.image_bytes[int(offsets[item]):int(offsets[item + 1])]
        where = f"{dataset.prefix}.images: image {item}"
        try:
            pixels = decode_rgb_pixels(data)
        except (ImageError, RuntimeError) as error:
            raise FormatError(f"{where}: {error}: the stored image is corrupted") from error
        if (pixels.shape[1], pixels.shape[0]) != (int(table[item]["width"]), int(table[item]["height"])):
            raise FormatError(f"{where} decodes to {pixels.shape[1]}x{pixels.shape[0]}, not the size image_info "
                              "records: the dataset is corrupted")
        transform.normalize_into(pixels, batch[slot])

    for _ in (pool.map(render, range(end - start)) if pool is not None else map(render, range(end - start))):
        pass
    return batch
