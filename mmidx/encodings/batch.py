"""Precached encodings in packed batches: which streams a group uses, their checks, and the batch keys.

``padded_latent`` is BAGEL's ``vae_model.encode(padded_images)`` in its padded layout: (n, C, max h,
max w) float32, each latent top-left, zeros elsewhere, in the order of ``patchified_vae_latent_shapes``.
Moments are not sampled in the loader: the pack ships ``padded_latent_moments`` (n, 2, C, max h, max w)
in the stored dtype, ``latent_sizes`` (n, 2) and ``latent_noise_key`` (seed, pack), and the sample is
drawn where the batch lives (:mod:`mmidx.encodings.noise`), a pure function of (config, seed, pack).
Likewise precached ViT encodings ship as ``packed_vit_embeddings_stored`` (tokens, D) in the stored dtype
and are widened to the float32 ``packed_vit_embeddings`` where the batch lives.

Text-input encodings (an encoder with a tokenizer of its own, e.g. T5 or CLIP: one record per text)
used as ``U`` appear as ``text_encoding_U`` (rows, max n, D) float32 zero-padded, one row per text
kept in the pack, in pack order, with ``text_encoding_U_lengths``, ``text_encoding_U_samples`` (the
sample's position in the pack) and ``text_encoding_U_elements`` (the element's number in its view).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from mmidx.config import DataConfig, GroupConfig
from mmidx.encodings.gather import PackRecord, copy_into, record_views, same_dtype, table_rows
from mmidx.format import FormatError
from mmidx.read.encoding_streams import IMG_NUM_RULE, EncodingStream, open_stream, stream_location

USES = {"vae": ("image", "vae"), "vit": ("image", "vit"), "text": ("text", None)}  # what each use's stream holds
TEXT_INPUT_USE = ("text", None)  # any other use (a name of letters, digits and _) is a text-input encoding


def text_encoding_keys(use: str) -> tuple[str, str, str, str]:
    """The batch keys of the text-input encoding used as ``use``: values, lengths, samples, elements."""
    key = f"text_encoding_{use}"
    return key, f"{key}_lengths", f"{key}_samples", f"{key}_elements"


def group_encodings(config: DataConfig, override: Mapping[str, str] | None) -> list[dict[str, str]]:
    """Per group, the stream name of each use ("vae", "vit", "text", or a text-input encoding's own name):
    ``override`` for all, else the group's own."""
    chosen = []
    for group in config.groups:
        names = dict(override if override is not None else group.encodings or {})
        bad = sorted(use for use in names if use not in USES and (not use.isidentifier() or not use.isascii()))
        if bad:
            raise ValueError(f"group {group.name!r}: encoding uses {bad} are not names; the uses are "
                             f"{sorted(USES)} or a text-input encoding's name (letters, digits, _)")
        chosen.append(names)
    return chosen


def mismatch(meta: dict[str, Any], group: GroupConfig, use: str) -> str | None:
    """What differs between a stream's recorded inputs and what ``group`` feeds ``use``, or None."""
    modality, transform = USES.get(use, TEXT_INPUT_USE)
    text_input = meta.get("input") == "text"
    if modality == "text" and meta["modality"] == "text" and text_input != (use not in USES):
        return "it holds text-input encodings (one record per text); use it under its own name, not as text" \
            if text_input else f"it holds token-aligned text encodings; use it as text, not as {use}"
    if meta["modality"] != modality or meta.get("transform") != transform:
        return f"it holds {meta['modality']} encodings of the {meta.get('transform')} transform, {use} needs " \
               f"{modality} encodings{f' of the {transform} transform' if transform else ''}"
    if transform is None:
        return None
    used = group.vae_transform if transform == "vae" else group.vit_transform
    args = json.loads(json.dumps(dataclasses.asdict(used))) if used else None
    recorded = meta.get("transform_args")
    if args != recorded:
        keys = sorted(set(args or {}) | set(recorded or {}))
        differ = [f"{key} {(recorded or {}).get(key)!r} vs the config's {(args or {}).get(key)!r}"
                  for key in keys if (recorded or {}).get(key) != (args or {}).get(key)] or ["transform"]
        return "its image transform differs: " + "; ".join(differ)
    if meta.get("img_num_rule") != IMG_NUM_RULE:
        return f"its img_num rule {meta.get('img_num_rule')!r} is not this mmidx's {IMG_NUM_RULE!r}"
    return None


def checked_streams(config: DataConfig, datasets: list[list[Any]], names: list[dict[str, str]]) -> None:
    """Open every stream the config uses and refuse, naming the difference, any computed from other inputs (a
    sharded dataset's streams are its shards', each beside its shard: a pack reads a sample's from its shard)."""
    for group, group_datasets, uses in zip(config.groups, datasets, names, strict=True):
        for use, name in uses.items():
            for dataset in (part.dataset for whole in group_datasets for part in whole.parts):
                stream = open_stream(dataset, name)  # refuses another version of the dataset
                problem = mismatch(stream.meta, group, use)
                if problem:
                    raise ValueError(f"{stream_location(dataset.prefix, name, 'json')} cannot serve as {use} "
                                     f"encodings of group {group.name!r}: {problem}; precache it again")


def latent(stream: EncodingStream, item: int, img_num: int, height: int, width: int, down: int) -> torch.Tensor:
    """The stored (C, h, w) or moments (2, C, h, w) of an image the pack resizes to (height, width)."""
    value = stream.tensor(item, img_num)
    h, w = value.shape[-2:] if value.dim() >= 3 else (0, 0)
    moments = stream.meta["store"] == "moments"
    if value.dim() != 3 + moments or (moments and value.shape[0] != 2) or not h or not w or height % h or \
            width % w or height // h != width // w or down % (height // h):
        raise FormatError(f"{stream_location(stream.prefix, stream.name, 'idx')}: image {item}'s record has shape "
                          f"{tuple(value.shape)}, which is no latent of a {height}x{width} image under a "
                          f"{down}-pixel latent patch: corrupted or from another transform")
    return value


def stored_buffer(shape: tuple[int, ...], dtype: torch.dtype, allocate: Callable[..., torch.Tensor]) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` in a stored dtype, in a (float32) batch buffer viewed as that dtype."""
    nbytes = math.prod(shape) * dtype.itemsize
    return allocate(-(-nbytes // 4)).view(torch.uint8)[:nbytes].view(dtype).view(shape)


def latent_tensors(records: list[PackRecord], seed: int, pack_index: int,
                   allocate: Callable[..., torch.Tensor] = torch.empty) -> dict[str, torch.Tensor]:
    """The batch keys of a pack's precached latents (:func:`latent`'s records): ``padded_latent`` (n, C, max h,
    max w) float32, each latent top-left, zeros elsewhere; or, for moments, ``padded_latent_moments`` (n, 2, C,
    max h, max w) in the stored dtype with ``latent_sizes`` and ``latent_noise_key``, sampled where the batch
    lives. Records stored in the buffer's dtype are copied as bytes, all at once (:mod:`mmidx.encodings.gather`)."""
    rows, numbers = table_rows(records)
    count, ndim, dims = len(records), rows["ndim"].astype(np.int64), rows["shape"].astype(np.int64)
    moments = np.array([record.stream.meta["store"] == "moments" for record in records])
    height, width, down = np.array([record.size for record in records], np.int64).T
    last = np.minimum(np.maximum(ndim, 3), 4) - 1  # the (C, h, w) of a (C, h, w) or (2, C, h, w) record
    channels, h, w = (dims[np.arange(count), last - back] for back in (2, 1, 0))
    some_h, some_w = np.maximum(h, 1), np.maximum(w, 1)  # divisors: a record with h or w 0 is refused anyway
    factor = height // some_h
    bad = (ndim != 3 + moments) | (moments & (dims[:, 0] != 2)) | (h <= 0) | (w <= 0) | (height % some_h != 0) \
        | (width % some_w != 0) | (factor != width // some_w) | (factor == 0) | (down % np.maximum(factor, 1) != 0)
    if bad.any():
        record = records[int(bad.argmax())]
        latent(record.stream, record.item, record.img_num, *record.size)  # raises its message
    if np.any(channels != channels[0]):
        raise FormatError("the precached latents of one pack have different channel counts: the streams come from "
                          "different encoders; use one encoding name for every group")
    if np.any(moments != moments[0]):
        raise FormatError("a pack mixes precached moments with single-tensor latents: precache every group's "
                          "VAE images with the same --store")
    planes, most_h, most_w = (2 if moments[0] else 1) * int(channels[0]), int(h.max()), int(w.max())
    if moments[0]:
        padded = stored_buffer((count, 2, int(channels[0]), most_h, most_w), records[0].stream.dtype, allocate)
    else:
        padded = allocate(count, int(channels[0]), most_h, most_w)
    sizes = list(zip(h.tolist(), w.tolist(), strict=True))
    for slot in np.flatnonzero((h < most_h) | (w < most_w)).tolist():  # only the padding is zeroed
        sh, sw = sizes[slot]
        if sh < most_h:
            padded[slot, ..., sh:, :].zero_()
        if sw < most_w:
            padded[slot, ..., :sh, sw:].zero_()
    if same_dtype(records, padded.dtype):
        itemsize = padded.element_size()
        whole = (h == most_h) & (w == most_w)  # a full slot is one run of bytes
        copy_into(padded, records, rows, np.arange(count, dtype=np.int64) * (planes * most_h * most_w * itemsize),
                  np.where(whole, 1, planes), np.where(whole, 1, h), np.where(whole, rows["nbytes"], w * itemsize),
                  most_h * most_w * itemsize, most_w * itemsize)
    else:
        for slot, value, (sh, sw) in zip(padded, record_views(records, numbers), sizes, strict=True):
            slot[..., :sh, :sw].copy_(value)
    if not moments[0]:
        return {"padded_latent": padded}
    return {"padded_latent_moments": padded, "latent_sizes": torch.tensor(sizes, dtype=torch.int64),
            "latent_noise_key": torch.tensor([seed, pack_index], dtype=torch.int64)}


def padded_text_encoding(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, max n, D) float32, each text's (n, D) record top-aligned and zeros below, and the (rows,) lengths."""
    dims = values[0].shape[1]
    if any(value.dim() != 2 or value.shape[1] != dims for value in values):
        raise FormatError("the text-input encodings of one pack have different widths: the streams come from "
                          "different encoders; use one encoding name for every group")
    lengths = torch.tensor([len(value) for value in values], dtype=torch.int64)
    padded = torch.zeros(len(values), int(lengths.max()) if len(values) else 0, dims)
    for row, value in enumerate(values):
        padded[row, :len(value)] = value
    return padded, lengths


def vit_embedding(stream: EncodingStream, item: int, img_num: int, height: int, width: int) -> torch.Tensor:
    """The stored (height, width, D) encoder output (token-major) of an image the pack cuts into height x width
    ViT patches."""
    value = stream.tensor(item, img_num)
    if value.dim() != 3 or tuple(value.shape[:2]) != (height, width):
        raise FormatError(f"{stream_location(stream.prefix, stream.name, 'idx')}: image {item}'s record has shape "
                          f"{tuple(value.shape)}, not ({height}, {width}, D) for its {height}x{width} ViT patches: "
                          "corrupted or from another encoder (patch size) or transform")
    return value


def packed_vit_embeddings(records: list[PackRecord], allocate: Callable[..., torch.Tensor] = torch.empty) \
        -> dict[str, torch.Tensor]:
    """The batch key of a pack's precached ViT encodings (:func:`vit_embedding`'s records):
    ``packed_vit_embeddings_stored`` (tokens, D) in the stored dtype, each image's (h, w, D) record in the order of
    ``packed_vit_tokens``, copied as bytes all at once (:mod:`mmidx.encodings.gather`); widened to the float32
    ``packed_vit_embeddings`` where the batch lives (:meth:`mmidx.pack.batch.PackedBatch.to`), so loader
    workers do not spend memory bandwidth on it."""
    rows, numbers = table_rows(records)
    dims = rows["shape"].astype(np.int64)
    grid = np.array([record.size for record in records], np.int64)
    bad = (rows["ndim"] != 3) | np.any(dims[:, :2] != grid, axis=1)
    if bad.any():
        record = records[int(bad.argmax())]
        vit_embedding(record.stream, record.item, record.img_num, *record.size)  # raises its message
    width, dtype = int(dims[0, 2]), records[0].stream.dtype
    if np.any(dims[:, 2] != width):
        raise FormatError("the precached ViT encodings of one pack have different widths: the streams come from "
                          "different encoders; use one encoding name for every group")
    if not same_dtype(records, dtype):  # groups precached at different dtypes
        dtype = torch.float32
    counts = grid[:, 0] * grid[:, 1]
    packed = stored_buffer((int(counts.sum()), width), dtype, allocate)
    if same_dtype(records, dtype):
        nbytes = rows["nbytes"]
        ones = np.ones(len(records), np.int64)
        copy_into(packed, records, rows, np.cumsum(nbytes) - nbytes, ones, ones, nbytes)
    else:
        start = 0
        for value, count in zip(record_views(records, numbers), counts.tolist(), strict=True):
            packed[start:start + count].copy_(value.view(count, width))
            start += count
    return {"packed_vit_embeddings_stored": packed}


def text_embedding(stream: EncodingStream, sequence: int, length: int | None) -> torch.Tensor:
    """The stored (L, D) embedding of a text sequence of ``length`` tokens (of any length for a text-input
    stream: ``length`` None)."""
    value = stream.tensor(sequence, 0)
    if value.dim() != 2 or (length is not None and value.shape[0] != length):
        raise FormatError(f"{stream_location(stream.prefix, stream.name, 'idx')}: sequence {sequence}'s record has "
                          f"shape {tuple(value.shape)}, not ({length or 'n'}, D): corrupted or from another dataset")
    return value
