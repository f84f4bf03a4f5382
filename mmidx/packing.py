"""A pack of samples → one batch in the layout of BAGEL's ``PackedDataset`` (``BAGEL_SEMANTICS.md``).

For every sample of a pack, element by element, this reproduces BAGEL's ``pack_sequence``: text
framed by ``<|im_start|>``/``<|im_end|>`` with labels shifted by one and weights 1/sqrt(n+1),
images framed by ``<|vision_start|>``/``<|vision_end|>``, rope ids (text +len, vit +1, clean vae
+1, noised vae +0, frame_delta, a gap for each dropped image and none for dropped text), splits
and attention modes, ViT patches with NaViT position ids, padded VAE inputs with latent position
ids, one timestep per noised image or clip (-inf for clean ones), and the key groups present only
when non-empty. It reproduces BAGEL's quirks too: a split is reset at ``split_start`` before CFG
dropout is decided, text and vit position ids advance by the running split length.

Differences, by design: a clip whose first or last frame is dropped by CFG dropout opens its split
on the first kept frame and closes it on the last kept one (BAGEL then writes ``split_lens`` and
``attn_modes`` of different lengths and ``sample_lens`` shorter than the tokens written);
randomness (CFG dropout, timesteps) comes from Philox keyed by (seed, pack index, sample position)
— no global RNG, so pack k is the same in any process, worker or resumed run; each stored image
is decoded once per pack however many elements use it; attention masks are not built here (split
metadata travels; :mod:`mmidx.masks` builds masks on the device).
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from mmidx import format as fmt
from mmidx.config import DataConfig, GroupConfig
from mmidx.dataset import MMIDXDataset, Sample
from mmidx.encodings import batch as encoded
from mmidx.encodings.store import open_stream
from mmidx.format import FormatError
from mmidx.images import (
    ImageError,
    ImageTransform,
    decode_jpeg_batch,
    decode_rgb_pixels,
    patchify,
    position_ids_extrapolate,
    position_ids_interpolate,
)

SPECIAL_TOKEN_NAMES = ("bos_token_id", "eos_token_id", "start_of_image", "end_of_image")


_ELEMENT_FIELDS = ("kind", "flags", "img_num", "frame_delta", "special_token_label", "payload")
if fmt.ELEMENT_DTYPE.names != _ELEMENT_FIELDS:  # _add_sample unpacks plan records in this order
    raise ImportError(f"mmidx.format's element fields {fmt.ELEMENT_DTYPE.names} are not {_ELEMENT_FIELDS}")


class PackItem(NamedTuple):
    """One sample of a pack: which group, dataset, sample and view (a named tuple, which the pack
    index's kernel makes without a Python call per item: ``items(k)`` is a few µs)."""

    group: int
    dataset: int
    sample: int
    view: int


def sample_randomness(seed: int, pack_index: int, position: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform and normal draws for the ``count`` elements of the sample at ``position`` of pack ``pack_index``.

    Philox is counter-based: the stream is a pure function of (seed, pack, position), independent
    of which process asks, in which order, and of every other sample.
    """
    generator = np.random.Generator(np.random.Philox(key=seed, counter=[0, 0, position, pack_index]))
    return generator.random(count), generator.standard_normal(count)


@dataclass
class _Pack:
    """The lists one pack accumulates, sample after sample (BAGEL's ``sequence_status``)."""

    curr: int = 0
    sample_lens: list[int] = field(default_factory=list)
    split_lens: list[list[int]] = field(default_factory=list)
    attn_modes: list[list[str]] = field(default_factory=list)
    text_ids: list[np.ndarray] = field(default_factory=list)
    text_indexes: list[np.ndarray] = field(default_factory=list)
    position_ids: list[np.ndarray] = field(default_factory=list)
    label_ids: list[np.ndarray] = field(default_factory=list)
    ce_indexes: list[np.ndarray] = field(default_factory=list)
    ce_weights: list[np.ndarray] = field(default_factory=list)
    vae_images: list[_ImageJob] = field(default_factory=list)
    vae_latents: list[torch.Tensor] = field(default_factory=list)  # precached, instead of vae_images
    text_embeddings: list[torch.Tensor] = field(default_factory=list)
    text_embedding_indexes: list[np.ndarray] = field(default_factory=list)
    vae_shapes: list[tuple[int, int]] = field(default_factory=list)
    latent_position_ids: list[torch.Tensor] = field(default_factory=list)
    vae_indexes: list[np.ndarray] = field(default_factory=list)
    timesteps: list[np.ndarray] = field(default_factory=list)
    mse_indexes: list[np.ndarray] = field(default_factory=list)
    vit_images: list[_ImageJob] = field(default_factory=list)
    vit_embeddings: list[torch.Tensor] = field(default_factory=list)  # precached, instead of vit_images
    vit_position_ids: list[torch.Tensor] = field(default_factory=list)
    vit_indexes: list[np.ndarray] = field(default_factory=list)
    vit_seqlens: list[int] = field(default_factory=list)
    data_indexes: list[dict[str, Any]] = field(default_factory=list)

    def add_special(self, token: int, loss_label: int | None) -> None:
        """One framing token at ``curr``; with a label when the element's special_token_loss is set."""
        self.text_ids.append(np.array([token], dtype=np.int64))
        self.text_indexes.append(np.array([self.curr], dtype=np.int64))
        if loss_label is not None:
            self.ce_indexes.append(np.array([self.curr], dtype=np.int64))
            self.ce_weights.append(np.ones(1))
            self.label_ids.append(np.array([loss_label], dtype=np.int64))
        self.curr += 1


@dataclass(frozen=True)
class _ImageJob:
    """One image element to render: which stored image, through which transform, at which size."""

    key: tuple[int, int, int, int]  # (group, dataset, sample, payload)
    sample: Sample
    transform: ImageTransform
    img_num: int
    height: int
    width: int


Stage = Callable[[str], AbstractContextManager[Any]]  # stage name -> a context that times it (benchmarks)
_UNTIMED = nullcontext()


def _untimed(stage: str) -> AbstractContextManager[Any]:
    return _UNTIMED


@functools.lru_cache(maxsize=65536)
def _output_size(transform: ImageTransform, width: int, height: int, img_num: int) -> tuple[int, int]:
    """(height, width) of a stored image after ``transform``: known from its probed size, no decoding."""
    widths, heights = transform.output_shapes(width, height, img_num)
    return int(heights), int(widths)


@functools.lru_cache(maxsize=4096)
def _position_ids(function: Callable[[int, int, int, int], torch.Tensor], height: int, width: int, patch: int,
                  side: int) -> torch.Tensor:
    """``function``'s position ids of a height x width image, computed once per size (batches copy them)."""
    return function(height, width, patch, side)


def _image_name(job: _ImageJob) -> str:
    return f"{job.sample.dataset.prefix}.images: image {job.key[3]} of sample {job.key[2]}"


@contextmanager
def _named(where: str) -> Iterator[None]:
    """Re-raise an undecodable stored image as a ``FormatError`` naming the file and the image."""
    try:
        yield
    except (ImageError, RuntimeError) as error:  # RuntimeError: nvJPEG's
        raise FormatError(f"{where}: {error}: the stored image is corrupted") from error


def _check_decoded_size(where: str, probed: tuple[int, int], decoded: tuple[int, int]) -> None:
    """Both decode paths: a stored image must decode to the (width, height) its ``image_info`` records,
    from which the pack's token counts were computed."""
    if tuple(decoded) != tuple(probed):
        raise FormatError(f"{where} decodes to {decoded[0]}x{decoded[1]}, but the image table (image_info) "
                          f"says {probed[0]}x{probed[1]}: the dataset is corrupted")


class _Pixels:
    """Decoded RGB pixels of one pack's images: each stored image is decoded once, however many elements use it."""

    def __init__(self, stage: Stage = _untimed) -> None:
        self.decoded: dict[tuple[int, ...], np.ndarray] = {}
        self.stage = stage

    def __call__(self, job: _ImageJob) -> np.ndarray:
        """The (H, W, 3) uint8 pixels of the stored image of ``job``, before resizing."""
        if job.key not in self.decoded:
            image = job.sample.image(job.key[3])
            where = _image_name(job)
            with self.stage("decode"), _named(where):
                decoded = decode_rgb_pixels(image.data)
            _check_decoded_size(where, (image.width, image.height), (decoded.shape[1], decoded.shape[0]))
            self.decoded[job.key] = decoded
        return self.decoded[job.key]


class PackBuilder:
    """Turns packs (lists of :class:`PackItem`) into :class:`PackedBatch` objects for one data config.

    ``datasets[g][d]`` is dataset d of group g (opened from the config when not given). Holds no
    mapped state that cannot be pickled: datasets re-map lazily in each worker.

    ``decode_images="loader"`` (default) decodes and transforms images where the batch is built,
    with BAGEL's exact pixels. ``"device"`` puts the encoded images in the batch instead and
    decodes them where it moves (:class:`DeferredImages`): JPEGs on the GPU with nvJPEG when
    torchvision is installed, resized with torch's antialiased bicubic in PIL's two passes (within
    2 levels of PIL's pixels),
    so loader workers ship compressed bytes and spend no time on pixels.

    ``stage`` (benchmarks, :mod:`mmidx.bench`): called with a stage name ("read", "decode",
    "resize", "normalise", "assemble"), it returns a context manager that times that stage; by
    default a shared no-op, so building costs the same as without it.

    ``encodings`` ({"vae": NAME, "vit": NAME, "text": NAME}, else each group's ``encodings``) uses
    precached encodings (:mod:`mmidx.encodings`): VAE elements bring ``padded_latent`` instead of
    ``padded_images`` (their images are never decoded); with "vit" (a frozen ViT's precached
    patch-embedding outputs), ViT elements bring ``packed_vit_embeddings`` (tokens, D) in the rows of
    ``packed_vit_tokens``, which is left out; texts bring ``packed_text_embeddings`` at
    ``packed_text_embedding_indexes``; streams computed from other inputs are refused.
    """

    def __init__(self, config: DataConfig, *, use_flex: bool = True,
                 datasets: Sequence[Sequence[MMIDXDataset]] | None = None,
                 special_tokens: dict[str, int] | None = None, decode_images: str = "loader",
                 stage: Stage = _untimed, encodings: dict[str, str] | None = None):
        if decode_images not in ("loader", "device"):
            raise ValueError(f"decode_images is 'loader' (exact BAGEL pixels, decoded where the batch is built) or "
                             f"'device' (encoded bytes travel, decoded where the batch moves), not {decode_images!r}")
        self.config = config
        self.use_flex = use_flex
        self.decode_images = decode_images
        self.stage = stage
        self.datasets = [list(group) for group in datasets] if datasets is not None else \
            [[MMIDXDataset(prefix) for prefix in group.datasets] for group in config.groups]
        self.special_tokens = special_tokens or self._special_tokens_of_datasets()
        missing = [name for name in SPECIAL_TOKEN_NAMES if name not in self.special_tokens]
        if missing:
            raise ValueError(f"special token ids {missing} are unknown: build the datasets with mmidx's tokenizer "
                             "or pass special_tokens")
        self.encodings = encoded.group_encodings(config, encodings)
        encoded.checked_streams(config, self.datasets, self.encodings)
        geometry = config.geometry
        self._position_ids = functools.partial(
            _position_ids, position_ids_interpolate if geometry.interpolate_pos else position_ids_extrapolate)

    def _special_tokens_of_datasets(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for group in self.datasets:
            for dataset in group:
                for name in SPECIAL_TOKEN_NAMES:
                    value = dataset.special_tokens.get(name)
                    if value is not None and found.setdefault(name, value) != value:
                        raise ValueError(f"datasets disagree on the id of {name} ({found[name]} vs {value}); "
                                         "mix only datasets built with the same tokenizer")
        return found

    def build(self, pack_index: int, items: Sequence[PackItem]) -> PackedBatch:
        """The batch of pack ``pack_index`` made of ``items``, in order."""
        pack = _Pack()
        worker = torch.utils.data.get_worker_info()
        worker_id = 0 if worker is None else worker.id
        for position, item in enumerate(items):
            dataset = self.datasets[item.group][item.dataset]
            with self.stage("read"):
                sample = dataset[item.sample]
                elements = sample.elements(item.view)
            uniforms, normals = sample_randomness(self.config.seed, pack_index, position, len(elements))
            self._add_sample(pack, item, sample, elements, uniforms, normals)
            pack.data_indexes.append({
                "dataset_name": self.config.groups[item.group].name, "worker_id": worker_id,
                "data_indexes": list(sample.origin), "dataset": dataset.prefix, "sample": item.sample,
                "view": item.view})
        return PackedBatch.from_pack(pack, use_flex=self.use_flex, max_num_tokens=self.config.packing.max_num_tokens,
                                     vit_patch_size=self.config.geometry.vit_patch_size,
                                     deferred=self.decode_images == "device", stage=self.stage,
                                     noise=(self.config.seed, pack_index))

    @staticmethod
    def _job(transform: ImageTransform | None, group: GroupConfig, kind: str, item: PackItem, sample: Sample,
             payload: int, img_num: int) -> _ImageJob:
        if transform is None:
            raise ValueError(f"group {group.name!r} has {kind} images but no image_transform_args in its config")
        image = sample.image(payload)
        height, width = _output_size(transform, image.width, image.height, img_num)
        return _ImageJob((item.group, item.dataset, item.sample, payload), sample, transform, img_num, height, width)

    @staticmethod
    def _stored_image(sample: Sample, job: _ImageJob) -> int:
        """The dataset-wide number of the stored image of ``job`` (what encoding streams are keyed by)."""
        return int(sample.dataset.plan["sample_image_offsets"][sample.index]) + job.key[3]

    def _add_sample(self, pack: _Pack, item: PackItem, sample: Sample,
                    elements: np.ndarray, uniforms: np.ndarray, normals: np.ndarray) -> None:
        group: GroupConfig = self.config.groups[item.group]
        dropout, geometry, special = self.config.dropout, self.config.geometry, self.special_tokens
        split_lens: list[int] = []
        attn_modes: list[str] = []
        rope = 0
        first_token = pack.curr
        split_len = 0
        timestep = None
        sample_len = 0
        opening = False  # a split has started and none of its elements is kept yet
        split_open = False  # a split holds kept elements and is not closed yet
        probability = {fmt.TEXT: dropout.text, fmt.VIT_IMAGE: dropout.vit, fmt.VAE_IMAGE: dropout.vae}
        uses = self.encodings[item.group]
        # One tuple of Python ints per record (_ELEMENT_FIELDS' order): cheaper than reading fields.
        for e, (kind, flags, img_num, frame_delta, label, payload) in enumerate(elements.tolist()):
            special_loss_label = label if flags & fmt.FLAG_SPECIAL_TOKEN_LOSS else None
            if flags & fmt.FLAG_SPLIT_START:
                split_len = 0
                opening = True
            if flags & fmt.FLAG_ENABLE_CFG and uniforms[e] < probability[kind]:
                rope += kind != fmt.TEXT  # a dropped image leaves a rope gap, a dropped text none
                if flags & fmt.FLAG_SPLIT_END and split_open:  # a clip's last frame: close on the last kept one
                    split_lens.append(split_len)
                    sample_len += split_len
                    split_open = False
                continue
            opens, opening, split_open = opening, False, True
            if kind == fmt.TEXT:
                ids = sample.text(payload).astype(np.int64)
                shifted = len(ids) + 1
                if "text" in uses:
                    first = sample.dataset.tokens.document_range(sample.index)[0]
                    pack.text_embeddings.append(encoded.text_embedding(
                        open_stream(sample.dataset, uses["text"]), first + payload, len(ids)))
                    pack.text_embedding_indexes.append(np.arange(pack.curr + 1, pack.curr + shifted))
                pack.text_ids.append(np.concatenate([[special["bos_token_id"]], ids]))
                pack.text_indexes.append(np.arange(pack.curr, pack.curr + shifted))
                if flags & fmt.FLAG_LOSS:
                    pack.ce_indexes.append(np.arange(pack.curr, pack.curr + shifted))
                    pack.ce_weights.append(np.full(shifted, 1 / shifted**0.5))  # BAGEL's len2weight
                    pack.label_ids.append(np.concatenate([ids, [special["eos_token_id"]]]))
                pack.curr += shifted
                split_len += shifted
                pack.add_special(special["eos_token_id"], special_loss_label)
                split_len += 1
                attn_modes.append("causal")
                pack.position_ids.append(np.arange(rope, rope + split_len))
                rope += split_len
            elif kind == fmt.VIT_IMAGE:
                pack.add_special(special["start_of_image"], None)
                split_len += 1
                job = self._job(group.vit_transform, group, "vit", item, sample, payload, img_num)
                patch = geometry.vit_patch_size
                tokens = (job.height // patch) * (job.width // patch)
                pack.vit_indexes.append(np.arange(pack.curr, pack.curr + tokens))
                pack.curr += tokens
                split_len += tokens
                if "vit" in uses:
                    pack.vit_embeddings.append(encoded.vit_embedding(
                        open_stream(sample.dataset, uses["vit"]), self._stored_image(sample, job), job.img_num,
                        job.height // patch, job.width // patch))
                else:
                    pack.vit_images.append(job)
                pack.vit_seqlens.append(tokens)
                pack.vit_position_ids.append(self._position_ids(
                    job.height, job.width, patch, geometry.max_num_patch_per_side))
                pack.add_special(special["end_of_image"], special_loss_label)
                split_len += 1
                attn_modes.append("full")
                pack.position_ids.append(np.full(split_len, rope))
                rope += 1
            else:
                pack.add_special(special["start_of_image"], None)
                split_len += 1
                job = self._job(group.vae_transform, group, "vae", item, sample, payload, img_num)
                down = geometry.vae_image_downsample
                height, width = job.height // down, job.width // down
                latent_tokens = height * width
                if "vae" in uses:
                    pack.vae_latents.append(encoded.latent(open_stream(sample.dataset, uses["vae"]),
                                                           self._stored_image(sample, job), job.img_num,
                                                           job.height, job.width, down))
                else:
                    pack.vae_images.append(job)
                pack.vae_shapes.append((height, width))
                pack.latent_position_ids.append(self._position_ids(
                    job.height, job.width, down, geometry.max_latent_size))
                pack.vae_indexes.append(np.arange(pack.curr, pack.curr + latent_tokens))
                noised = bool(flags & fmt.FLAG_LOSS)
                if noised:
                    pack.mse_indexes.append(np.arange(pack.curr, pack.curr + latent_tokens))
                    if opens or timestep is None:
                        timestep = float(normals[e])
                    value = timestep
                else:
                    value = float("-inf")
                pack.timesteps.append(np.full(latent_tokens, value))
                pack.curr += latent_tokens
                split_len += latent_tokens
                pack.add_special(special["end_of_image"], special_loss_label)
                split_len += 1
                has_frame_delta = bool(flags & fmt.FLAG_HAS_FRAME_DELTA)
                if opens:  # a clip's first frame: the split opens on the first kept one
                    attn_modes.append("noise" if noised and not has_frame_delta else "full")
                pack.position_ids.append(np.full(latent_tokens + 2, rope))
                if has_frame_delta:
                    rope += frame_delta
                elif not noised:
                    rope += 1
            if flags & fmt.FLAG_SPLIT_END:
                split_lens.append(split_len)
                sample_len += split_len
                split_open = False
        if len(split_lens) != len(attn_modes) or sample_len != pack.curr - first_token:
            raise FormatError(f"{sample.dataset.prefix}.plan: view {item.view} of sample {item.sample}: the split "
                              "flags (split_start, split_end) of its elements do not make whole splits: corrupted")
        pack.sample_lens.append(sample_len)
        pack.split_lens.append(split_lens)
        pack.attn_modes.append(attn_modes)



def _cat(arrays: list[np.ndarray], dtype: Any) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype))


def _madvise() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):  # not a POSIX libc: plain pages
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


_MADVISE = _madvise() if sys.platform.startswith("linux") else None
_MADV_HUGEPAGE = 14
_PAGE = 4096


class _BufferPool:
    """Float32 buffers for the large batch keys, reused once no batch uses them any more.

    A fresh buffer of tens of MB is mmapped by the allocator, and filling it is dominated by its
    first-touch page faults, the kernel zeroing every page (2.2 ms per 512² image with 4 KiB pages,
    0.6 ms with 2 MiB ones, measured here; ``madvise(MADV_HUGEPAGE)`` asks for the latter). A reused
    buffer is faulted in already. Buffers are numpy arrays handed out as tensors viewing them: every
    tensor, view or array derived from a batch key keeps its buffer referenced (a copy moved to shared
    memory by a DataLoader worker lets it go), so a buffer whose only references are the pool's is
    free. At most ``size`` buffers are kept; when all are in use, a new unpooled one is made.
    """

    def __init__(self, size: int = 4):
        self.size = size
        self.buffers: list[np.ndarray] = []
        self.lock = threading.Lock()

    def take(self, *shape: int) -> torch.Tensor:
        """An uninitialised float32 CPU tensor of ``shape``."""
        count = math.prod(shape)
        with self.lock:
            # Unused: referenced only by the pool's list and by getrefcount's own argument.
            free = [i for i in range(len(self.buffers)) if sys.getrefcount(self.buffers[i]) == 2]
            fitting = [i for i in free if self.buffers[i].size >= count]
            if fitting:
                buffer = self.buffers[fitting[0]]
            else:
                buffer = _huge_pages(np.empty(count, np.float32))
                if free:
                    self.buffers[free[0]] = buffer  # replace a free buffer that is too small
                elif len(self.buffers) < self.size:
                    self.buffers.append(buffer)
        return torch.from_numpy(buffer[:count]).view(shape)


def _huge_pages(array: np.ndarray) -> np.ndarray:
    """``array`` (not touched yet), with the kernel asked to back it by transparent huge pages where it can."""
    if _MADVISE is not None and array.nbytes >= 2 << 20:
        start = -(-array.ctypes.data // _PAGE) * _PAGE
        end = (array.ctypes.data + array.nbytes) // _PAGE * _PAGE
        _MADVISE(start, end - start, _MADV_HUGEPAGE)
    return array


_BUFFERS = _BufferPool()


def _batch_buffer(*shape: int) -> torch.Tensor:
    """An uninitialised float32 CPU tensor for a large batch key, from the process's pool (``_BufferPool``)."""
    return _BUFFERS.take(*shape)


def _padded_images(jobs: list[_ImageJob], pixels: _Pixels) -> torch.Tensor:
    """BAGEL's ``padded_images``: (n, 3, max H, max W) float32, each image top-left, zeros elsewhere.

    Written in place: only the padding is zeroed, and each image is resized and normalised straight into
    its slot in one pass.
    """
    height, width = max(job.height for job in jobs), max(job.width for job in jobs)
    padded = _batch_buffer(len(jobs), 3, height, width)
    for slot, job in zip(padded, jobs, strict=True):
        slot[:, job.height:, :].zero_()
        slot[:, : job.height, job.width:].zero_()
        job.transform.normalize_into(pixels(job), slot[:, : job.height, : job.width])
    return padded


def _vit_tokens(jobs: list[_ImageJob], counts: list[int], patch: int, pixels: _Pixels) -> torch.Tensor:
    """``packed_vit_tokens``: every image's patches (row-major; inside a patch (row, column, channel)),
    resized and normalised straight from the decoded pixels into their rows of one buffer (BAGEL's ``patchify``)."""
    tokens = _batch_buffer(sum(counts), patch * patch * 3)
    start = 0
    for job, count in zip(jobs, counts, strict=True):
        job.transform.patches_into(pixels(job), tokens[start:start + count], patch, job.height, job.width)
        start += count
    return tokens


@dataclass
class DeferredImages:
    """A pack's images, still encoded, with what each image element needs: decoded on the device.

    ``encoded`` holds each distinct stored image once (uint8 CPU tensors of its bytes); ``vae`` and
    ``vit`` list, in element order, (image number, transform, height, width). The same code runs
    on CPU and CUDA: decode (:func:`mmidx.images.decode_jpeg_batch`), resize with antialiased
    bicubic, normalise with torchvision's float32 arithmetic, write the batch keys.
    """

    encoded: list[torch.Tensor]
    vae: list[tuple[int, ImageTransform, int, int]]
    vit: list[tuple[int, ImageTransform, int, int]]
    patch_size: int
    probed: list[tuple[str, int, int]]  # per encoded image: where it is stored, its image_info width, height

    @classmethod
    def of(cls, vae_jobs: list[_ImageJob], vit_jobs: list[_ImageJob], patch_size: int) -> DeferredImages:
        numbers: dict[tuple[int, ...], int] = {}
        encoded: list[torch.Tensor] = []
        probed: list[tuple[str, int, int]] = []
        for job in [*vae_jobs, *vit_jobs]:
            if job.key not in numbers:
                numbers[job.key] = len(encoded)
                image = job.sample.image(job.key[3])
                encoded.append(torch.frombuffer(bytearray(image.data), dtype=torch.uint8))
                probed.append((_image_name(job), image.width, image.height))

        def entries(jobs: list[_ImageJob]) -> list[tuple[int, ImageTransform, int, int]]:
            return [(numbers[job.key], job.transform, job.height, job.width) for job in jobs]

        return cls(encoded, entries(vae_jobs), entries(vit_jobs), patch_size, probed)

    def pin_memory(self) -> DeferredImages:
        return DeferredImages([data.pin_memory() for data in self.encoded], self.vae, self.vit, self.patch_size,
                              self.probed)

    def render(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """``padded_images`` and ``packed_vit_tokens`` (those present) on ``device``."""
        with _named(", ".join(sorted({where.split(":")[0] for where, _, _ in self.probed}))):
            decoded = decode_jpeg_batch([data.numpy() for data in self.encoded], device)
        for (where, width, height), pixels in zip(self.probed, decoded, strict=True):
            _check_decoded_size(where, (width, height), (pixels.shape[2], pixels.shape[1]))
        resized: dict[tuple[int, int, int], torch.Tensor] = {}

        def image(number: int, transform: ImageTransform, height: int, width: int) -> torch.Tensor:
            if (number, height, width) not in resized:
                pixels = decoded[number].float()[None]
                # PIL resizes the width, rounds and clips to 8 bits, then the height: so does this (one
                # 2-D pass instead differs by up to 24 levels where bicubic overshoots, e.g. on noise).
                for size in ((pixels.shape[2], width), (height, width)):
                    if pixels.shape[2:] != size:
                        pixels = torch.nn.functional.interpolate(pixels, size=size, mode="bicubic", antialias=True,
                                                                 align_corners=False).round_().clamp_(0, 255)
                resized[number, height, width] = pixels[0]
            pixels = resized[number, height, width]
            mean, std = (torch.tensor(v, dtype=torch.float32, device=pixels.device).view(3, 1, 1)
                         for v in (transform.image_mean, transform.image_std))
            return pixels.div(255).sub_(mean).div_(std)

        out: dict[str, torch.Tensor] = {}
        if self.vae:
            height, width = max(entry[2] for entry in self.vae), max(entry[3] for entry in self.vae)
            padded = torch.zeros(len(self.vae), 3, height, width, device=device)
            for slot, entry in zip(padded, self.vae, strict=True):
                slot[:, : entry[2], : entry[3]] = image(*entry)
            out["padded_images"] = padded
        if self.vit:
            out["packed_vit_tokens"] = torch.cat([patchify(image(*entry), self.patch_size) for entry in self.vit])
        return out


class PackedBatch:
    """One packed batch: BAGEL's keys as tensors, plus the split metadata masks are built from.

    ``to(device)`` (and BAGEL's ``cuda(device)``) moves every tensor; ``attention_masks()`` /
    ``to_dict()`` build the masks on the batch's device (dense per-sample masks, or a FlexAttention
    ``BlockMask``), so masks never travel between processes. ``batch_data_indexes`` has one entry per
    sample with BAGEL's ``dataset_name`` (the group), ``worker_id`` (the DataLoader worker that built
    the pack) and ``data_indexes`` ([input file, row]), plus mmidx's ``dataset``, ``sample``, ``view``.
    """

    def __init__(self, tensors: dict[str, Any], *, split_lens: list[list[int]], attn_modes: list[list[str]],
                 sample_lens: list[int], use_flex: bool, max_num_tokens: int,
                 batch_data_indexes: list[dict[str, Any]], deferred: DeferredImages | None = None):
        self.tensors = tensors
        self.deferred = deferred
        self.split_lens = split_lens
        self.attn_modes = attn_modes
        self.sample_lens = sample_lens
        self.use_flex = use_flex
        self.max_num_tokens = max_num_tokens
        self.batch_data_indexes = batch_data_indexes

    @classmethod
    def from_pack(cls, pack: _Pack, *, use_flex: bool, max_num_tokens: int, vit_patch_size: int,
                  deferred: bool = False, stage: Stage = _untimed, noise: tuple[int, int] = (0, 0)) -> PackedBatch:
        pixels = _Pixels(stage)
        if pack.vae_images and pack.vae_latents:
            raise ValueError("a pack mixes VAE images with precached latents: name the vae encodings for every "
                             "group with VAE images (or for none)")
        if pack.vit_images and pack.vit_embeddings:
            raise ValueError("a pack mixes ViT images with precached ViT encodings: name the vit encodings for "
                             "every group with ViT images (or for none)")
        tensors: dict[str, Any] = {
            "packed_text_ids": _cat(pack.text_ids, np.int64),
            "packed_text_indexes": _cat(pack.text_indexes, np.int64),
            "packed_position_ids": _cat(pack.position_ids, np.int64),
        }
        if pack.vae_latents:
            with stage("assemble"):
                tensors["padded_latent"] = encoded.padded_latent(pack.vae_latents, *noise, _batch_buffer)
        if pack.text_embeddings:
            tensors.update(packed_text_embeddings=torch.cat([value.float() for value in pack.text_embeddings]),
                           packed_text_embedding_indexes=_cat(pack.text_embedding_indexes, np.int64))
        if pack.vae_images or pack.vae_latents:
            if pack.vae_images and not deferred:
                with stage("normalise"):
                    tensors["padded_images"] = _padded_images(pack.vae_images, pixels)
            tensors.update(patchified_vae_latent_shapes=pack.vae_shapes,
                           packed_latent_position_ids=torch.cat(pack.latent_position_ids),
                           packed_vae_token_indexes=_cat(pack.vae_indexes, np.int64))
        if pack.vit_embeddings:
            with stage("assemble"):
                tensors["packed_vit_embeddings"] = encoded.packed_vit_embeddings(pack.vit_embeddings, _batch_buffer)
        if pack.vit_images or pack.vit_embeddings:
            if pack.vit_images and not deferred:
                with stage("normalise"):
                    tensors["packed_vit_tokens"] = _vit_tokens(pack.vit_images, pack.vit_seqlens, vit_patch_size,
                                                               pixels)
            tensors.update(packed_vit_position_ids=torch.cat(pack.vit_position_ids),
                           packed_vit_token_indexes=_cat(pack.vit_indexes, np.int64),
                           vit_token_seqlens=torch.tensor(pack.vit_seqlens, dtype=torch.int64))
        if pack.timesteps:
            tensors.update(packed_timesteps=_cat(pack.timesteps, np.float32),
                           mse_loss_indexes=_cat(pack.mse_indexes, np.int64))
        if pack.label_ids:
            tensors.update(packed_label_ids=_cat(pack.label_ids, np.int64),
                           ce_loss_indexes=_cat(pack.ce_indexes, np.int64),
                           ce_loss_weights=_cat(pack.ce_weights, np.float32))
        with stage("read"):
            images = DeferredImages.of(pack.vae_images, pack.vit_images, vit_patch_size) \
                if deferred and (pack.vae_images or pack.vit_images) else None
        return cls(tensors, split_lens=pack.split_lens, attn_modes=pack.attn_modes, sample_lens=pack.sample_lens,
                   use_flex=use_flex, max_num_tokens=max_num_tokens, batch_data_indexes=pack.data_indexes,
                   deferred=images)

    @property
    def sequence_length(self) -> int:
        """Tokens of the real samples (without the flex padding pseudo-sample)."""
        return sum(self.sample_lens)

    @property
    def device(self) -> torch.device:
        return self.tensors["packed_text_ids"].device

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._materialize()
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(f"PackedBatch has no {name!r} (present keys: {sorted(tensors)})")

    def _materialize(self) -> None:
        """Decode deferred images where the batch is (a no-op for batches decoded in the loader)."""
        if self.__dict__.get("deferred") is not None:
            self.tensors.update(self.deferred.render(self.device))
            self.deferred = None

    def _map(self, function: Any, deferred: DeferredImages | None) -> PackedBatch:
        tensors = {key: function(value) if isinstance(value, torch.Tensor) else value
                   for key, value in self.tensors.items()}
        return PackedBatch(tensors, split_lens=self.split_lens, attn_modes=self.attn_modes,
                           sample_lens=self.sample_lens, use_flex=self.use_flex, max_num_tokens=self.max_num_tokens,
                           batch_data_indexes=self.batch_data_indexes, deferred=deferred)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The batch with every tensor on ``device`` (deferred images are decoded there)."""
        moved = self._map(lambda tensor: tensor.to(device, non_blocking=non_blocking), self.deferred)
        moved._materialize()
        return moved

    def cuda(self, device: torch.device | str | int | None = None, non_blocking: bool = False) -> PackedBatch:
        """BAGEL's ``SimpleCustomBatch.cuda(device)``: :meth:`to` with a CUDA device (an int is its index)."""
        if device is None or isinstance(device, int):
            device = torch.device("cuda", device)
        return self.to(device, non_blocking=non_blocking)

    def pin_memory(self) -> PackedBatch:
        """Page-locked copies (``DataLoader(pin_memory=True)`` calls this); deferred images stay encoded."""
        return self._map(lambda tensor: tensor.pin_memory(),
                         None if self.deferred is None else self.deferred.pin_memory())

    def flat_split_metadata(self, *, pad: bool) -> tuple[list[int], list[str], list[int]]:
        """(split_lens, attn_modes, sample_lens) over the whole pack, with the flex padding sample if ``pad``."""
        split_lens = [length for sample in self.split_lens for length in sample]
        attn_modes = [mode for sample in self.attn_modes for mode in sample]
        sample_lens = list(self.sample_lens)
        if pad:
            pad_len = self.max_num_tokens - self.sequence_length
            split_lens.append(pad_len)
            attn_modes.append("causal")
            sample_lens.append(pad_len)
        return split_lens, attn_modes, sample_lens

    def attention_masks(self, *, dtype: torch.dtype = torch.float32) -> Any:
        """Masks on the batch's device: a ``BlockMask`` (flex) or one dense (L_i, L_i) mask per sample."""
        from mmidx import masks

        if self.use_flex:
            return masks.block_mask(*self.flat_split_metadata(pad=True), device=self.device)
        return masks.dense_masks(*self.flat_split_metadata(pad=False), device=self.device, dtype=dtype)

    def to_dict(self) -> dict[str, Any]:
        """BAGEL's batch dict: every present key, with ``nested_attention_masks`` (dense) built on the
        batch's device, or ``split_lens``/``attn_modes`` with the padding pseudo-sample (flex)."""
        self._materialize()
        split_lens, attn_modes, sample_lens = self.flat_split_metadata(pad=self.use_flex)
        data: dict[str, Any] = {"sequence_length": self.sequence_length, "sample_lens": sample_lens}
        data.update(self.tensors)
        if self.use_flex:
            data.update(split_lens=split_lens, attn_modes=attn_modes)
        else:
            data["nested_attention_masks"] = self.attention_masks()
        data["batch_data_indexes"] = self.batch_data_indexes
        return data
