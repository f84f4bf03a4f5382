"""Running frozen encoders over a dataset: the job of each (``Job``), the units of work (images grouped by
output shape, or text sequences: ``plan_units``), and one batch encoded by every encoder of a pass
(``encode_batch``: pixels, token ids or strings made once and fed to each), shared by the local and
the Ray engines of :mod:`mmidx.encodings.precache`.
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
from mmidx.read.encoding_streams import DTYPES, stream_records
from mmidx.tokenizer import recorded_tokenizer

RECORD_SIZE = fmt.ENCODING_RECORD.itemsize


@dataclasses.dataclass(frozen=True)
class Job:
    """What one encoding of a precache computes: the options that decide its bytes.

    ``encoder`` is ``pkg.module:factory`` or ``pkg.module.Class``, called with ``encoder_kwargs``.
    A text encoder reads the dataset's token ids (``input="tokens"``: (B, L) of one length, its
    output stored token for token) or the texts' strings (``input="text"``: a list of str, decoded
    with the dataset's tokenizer, for encoders with a tokenizer of their own); with
    ``store_pad_tokens=False`` it returns ``(embeddings, mask)`` and only the masked-in rows are kept."""

    name: str
    encoder: str  # "pkg.module:factory" or "pkg.module.Class"
    modality: str = "image"  # image | text
    transform: str = "vae"  # vae | vit: which of the group's transforms (and element kind) feeds the encoder
    store: str = "moments"  # moments | mean | sample (a single-tensor output is stored as is)
    dtype: str = "bf16"
    batch_size: int = 16
    weights_version: str | None = None
    input: str = "tokens"  # text encoders: tokens | text
    store_pad_tokens: bool = True  # text: False = the encoder returns (embeddings, mask); masked-in rows kept
    encoder_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.modality not in ("image", "text") or self.transform not in ("vae", "vit") or \
                self.store not in ("moments", "mean", "sample") or self.dtype not in DTYPES or self.batch_size < 1 \
                or self.input not in ("tokens", "text"):
            raise ValueError(f"bad precache options {self}: modality image|text, transform vae|vit, "
                             "store moments|mean|sample, dtype bf16|fp16|fp32, batch size >= 1, input tokens|text")
        if self.modality == "text" and self.input == "tokens" and not self.store_pad_tokens:
            raise ValueError(f"encoding {self.name!r}: store_pad_tokens: false needs input: text (token-input "
                             "encodings are stored token for token, aligned with packed_text_ids)")
        fmt.encoding_path("p", self.name, "json")  # the name check

    @property
    def reads(self) -> tuple[str, str | None, int]:
        """What the encoder is fed, batched how: one pass makes it once for every job that reads the same."""
        return self.modality, self.transform if self.modality == "image" else None, self.batch_size

    @property
    def fingerprint(self) -> dict[str, Any]:
        """The options as plain data (what a resumed run must share, and the JSON records)."""
        return json_safe(dataclasses.asdict(self))


def json_safe(value: Any) -> Any:
    """``value`` as JSON would give it back (tuples as lists, keys as strings)."""
    import json

    return json.loads(json.dumps(value, sort_keys=True, default=repr))


@dataclasses.dataclass
class RunOptions:
    """How a precache runs (nothing here changes its bytes): where, on how many threads or Ray workers."""

    device: str = "cpu"
    workers: int = 1  # local: threads decoding and transforming; ray: encoder actors
    progress: bool = True
    engine: str = "local"  # local | ray
    ray_address: str | None = None
    encoders: list[Callable[..., Any]] | None = None  # encoders already loaded, one per job (local engine only)
    force: bool = False  # replace a finished stream of the same name that other options computed


def encoder_factory(spec: str) -> Callable[..., Any]:
    """The factory or class that ``pkg.module:factory`` or ``pkg.module.Class`` names, imported (a ValueError
    saying what is wrong if not)."""
    module_name, colon, attribute = spec.partition(":")
    if not colon:
        module_name, _, attribute = spec.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"encoder {spec!r}: give it as pkg.module:factory or pkg.module.Class")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"encoder {spec!r}: cannot import it ({error}); is its package on PYTHONPATH?") from error


def load_encoder(job: Job, device: str = "cpu") -> Callable[..., Any]:
    """The job's encoder, ``factory(**encoder_kwargs)``, on ``device`` and in eval mode when it is a module:
    its ``encode`` method when it has one (the seed's convention), else the object itself."""
    try:
        encoder = encoder_factory(job.encoder)(**job.encoder_kwargs)
    except TypeError as error:
        raise ValueError(f"encoding {job.name!r}: {job.encoder}(**{job.encoder_kwargs}) fails: {error}") from error
    if isinstance(encoder, torch.nn.Module):
        encoder.eval().requires_grad_(False).to(device)
    encode = getattr(encoder, "encode", None)
    return encode if callable(encode) else encoder


def _outputs(result: Any, job: Job, items: np.ndarray, img_nums: np.ndarray) -> tuple[list[torch.Tensor], str]:
    """The values to store, one per record, and the store name recorded: moments stack (mean, logvar) on dim 0
    of each record; a text encoder's (embeddings, mask) keeps each text's masked-in rows."""
    if job.modality == "text":
        if job.store_pad_tokens:
            if not isinstance(result, torch.Tensor) or result.dim() != 3 or len(result) != len(items):
                raise ValueError(f"encoding {job.name!r}: the text encoder must return a (B, L, D) tensor "
                                 f"(store_pad_tokens: true), not {_described(result)}")
            return list(result.unbind(0)), "tensor"
        if not (isinstance(result, (tuple, list)) and len(result) == 2 and all(
                isinstance(part, torch.Tensor) for part in result)) or result[0].dim() != 3 or \
                tuple(result[1].shape) != tuple(result[0].shape[:2]) or len(result[0]) != len(items):
            raise ValueError(f"encoding {job.name!r}: with store_pad_tokens: false the text encoder must return "
                             f"(embeddings (B, L, D), mask (B, L)), not {_described(result)}")
        embeddings, mask = result[0], result[1].bool()
        return [rows[keep] for rows, keep in zip(embeddings, mask, strict=True)], "tensor"
    if isinstance(result, torch.Tensor):
        return list(result.unbind(0)), "tensor"
    if isinstance(result, (tuple, list)) and len(result) == 2:
        mean, logvar = result
    elif hasattr(result, "mean") and hasattr(result, "logvar"):  # e.g. a diagonal Gaussian posterior
        mean, logvar = result.mean, result.logvar
    else:
        raise ValueError(f"encoding {job.name!r}: the encoder returned neither a tensor, nor (mean, logvar), nor "
                         f"an object with .mean and .logvar, but {_described(result)}")
    if job.store == "moments":
        return list(torch.stack([mean, logvar], dim=1).unbind(0)), job.store
    if job.store == "mean":
        return list(mean.unbind(0)), job.store
    noise = torch.stack([torch.from_numpy(record_noise(int(item), int(img_num), tuple(mean.shape[1:])))
                         for item, img_num in zip(items, img_nums, strict=True)]).to(mean.device)
    return list((mean + torch.exp(0.5 * logvar.float()) * noise).unbind(0)), job.store


def _described(result: Any) -> str:
    if isinstance(result, torch.Tensor):
        return f"a tensor of shape {tuple(result.shape)}"
    if isinstance(result, (tuple, list)):
        return f"a {type(result).__name__} of {len(result)}: {', '.join(_described(part) for part in result)}"
    return type(result).__name__


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
    if job.modality == "text":
        items, img_nums = stream_records(dataset, "text", None)
        lengths = np.asarray(dataset.tokens.sequence_lengths, dtype=np.int64)[items]
        shapes = np.stack([lengths, np.zeros_like(lengths)], axis=1)
    else:
        if plan is None:
            raise ValueError(f"{dataset.prefix} is a text dataset: it has no images to precache")
        if transform is None:
            raise ValueError(f"{dataset.prefix}: no {job.transform} image transform in the config")
        items, img_nums = stream_records(dataset, "image", job.transform)
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


def encode_batch(dataset: MMIDXDataset, jobs: list[Job], transform: ImageTransform | None, units: Units, b: int,
                 encoders: list[Callable[..., Any]], device: str, pool: ThreadPoolExecutor | None = None,
                 skip: frozenset[int] = frozenset()) -> list[tuple[list[torch.Tensor], str] | None]:
    """Batch ``b`` encoded by every job's encoder (but those numbered in ``skip``, whose result is None): per
    job, one CPU tensor per record in the stored dtype, and the store its output type gives. The input is
    made once for all: pixels, token ids, or the texts' strings."""
    start, end = units.bounds[b], units.bounds[b + 1]
    images = jobs[0].modality == "image"
    pixels = _pixels(dataset, transform, units, start, end, pool).to(device) if images else None
    ids: torch.Tensor | None = None
    strings: list[str] | None = None
    results: list[tuple[list[torch.Tensor], str] | None] = []
    with torch.inference_mode():
        for number, (job, encoder) in enumerate(zip(jobs, encoders, strict=True)):
            if number in skip:
                results.append(None)
                continue
            if images:
                inputs: Any = pixels
            elif job.input == "tokens":
                ids = _token_ids(dataset, units, start, end).to(device) if ids is None else ids
                inputs = ids
            else:
                strings = _strings(dataset, units, start, end) if strings is None else strings
                inputs = strings
            values, store = _outputs(encoder(inputs), job, units.items[start:end], units.img_nums[start:end])
            values = [value.to("cpu", DTYPES[job.dtype]) for value in values]
            if images and job.transform == "vit" and values and values[0].dim() == 3:
                values = [value.permute(1, 2, 0) for value in values]  # token-major (h, w, D): packs copy rows
            results.append((values, store))
    return results


def _token_ids(dataset: MMIDXDataset, units: Units, start: int, end: int) -> torch.Tensor:
    """(B, L) token ids of one batch of text sequences (of one length)."""
    return torch.stack([torch.from_numpy(dataset.get_tokens(int(item)).astype(np.int64))
                        for item in units.items[start:end]])


def _strings(dataset: MMIDXDataset, units: Units, start: int, end: int) -> list[str]:
    """The texts of one batch, decoded with the tokenizer the dataset was built with."""
    tokenizer = recorded_tokenizer(dataset.tokenizer, dataset.prefix)
    return [tokenizer.decode(dataset.get_tokens(int(item)).tolist()) for item in units.items[start:end]]


def _pixels(dataset: MMIDXDataset, transform: ImageTransform | None, units: Units, start: int, end: int,
            pool: ThreadPoolExecutor | None) -> torch.Tensor:
    """(B, 3, H, W) pixels of one batch, exactly as packs make them."""
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
