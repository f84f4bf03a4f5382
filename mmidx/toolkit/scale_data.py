"""Synthetic datasets of any size, written directly (no image encoding, no tokenizing): what the scale benchmark
(``benchmarks/bench_scale.py``) and the scale tests run every command on.

Each sample is a text-to-image pair as ``mmidx build --source t2i`` writes it: one caption (4 to 12 token ids
drawn from the tokenizer's vocabulary, special ids excluded) and one image, with BAGEL's t2i plan (the caption
with ``enable_cfg``, then the image as a noised VAE element with loss). The image is one of a few tiny real PNGs
of different sizes, so every command that probes or decodes sees real images and token counts vary. Everything
is a function of the sample's number and ``seed`` (a sharded set holds the same samples as one set of files),
written a chunk of 2^20 samples at a time (memory bounded whatever the size); with ``shards`` > 1 the samples are
split into that many shards under a shard table, as a build of that many units ends (:mod:`mmidx.format`).
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmidx import format as fmt
from mmidx.ingest.sharded import write_sharded
from mmidx.ingest.writer import _DatasetWriter
from mmidx.sources.elements import Element

CHUNK = 1 << 20
IMAGE_SIZES = ((16, 16), (32, 16), (16, 32), (32, 32))  # (width, height) of the images, one per sample in turn
SOURCE = "t2i"  # recorded as the build's source: the samples are t2i pairs (export, transforms, subsets read it)
PLAN = (Element("text", 0, enable_cfg=True).record(), Element("vae_image", 0, loss=True).record())


def _images() -> tuple[list[bytes], np.ndarray]:
    """The tiny PNGs (one per size) and their ``image_info`` records."""
    encoded, info = [], np.zeros(len(IMAGE_SIZES), fmt.IMAGE_DTYPE)
    for number, (width, height) in enumerate(IMAGE_SIZES):
        stream = io.BytesIO()
        Image.new("RGB", (width, height), (40 * number, 90, 200)).save(stream, format="PNG")
        encoded.append(stream.getvalue())
        info[number] = (width, height, fmt.IMAGE_FORMATS.index("PNG"), fmt.IMAGE_MODES.index("RGB"), 0, 0)
    return encoded, info


def _lengths(first: int, count: int, seed: int) -> np.ndarray:
    """Caption lengths (4..12 tokens) of samples ``first .. first + count``: a hash of the number and seed."""
    numbers = np.arange(first, first + count, dtype=np.uint64)
    mixed = (numbers + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    return (4 + (mixed >> np.uint64(59)) % np.uint64(9)).astype(np.int32)


def write_synthetic(prefix: str | os.PathLike, samples: int, *, shards: int = 1, tokenizer: Any = None,
                    seed: int = 0) -> Path:
    """Write ``samples`` synthetic t2i samples at ``prefix``: one set of files, or ``shards`` shards under a table.

    ``tokenizer`` (a :class:`mmidx.tokenizer.Tokenizer`) is recorded as the datasets' tokenizer and bounds the
    token ids; without one, ids are below 32,000 and none is recorded."""
    if samples < 1 or not 1 <= shards <= samples:
        raise ValueError(f"need 1 <= shards <= samples, got {shards} shards of {samples} samples")
    prefix = os.fspath(prefix)
    bounds = np.linspace(0, samples, shards + 1).astype(np.int64)
    if shards == 1:
        return _write_one(prefix, 0, samples, tokenizer, seed)
    for number in range(shards):
        _write_one(fmt.shard_prefix(prefix, number), int(bounds[number]), int(bounds[number + 1]), tokenizer, seed)
    return write_sharded(prefix, list(range(shards)),
                         {"source": SOURCE, "synthetic": {"samples": samples, "seed": seed}})


def _write_one(prefix: str, first: int, end: int, tokenizer: Any, seed: int) -> Path:
    """Samples ``first .. end`` (of the whole synthetic set) as one dataset at ``prefix``."""
    vocab = tokenizer.vocab_size if tokenizer is not None else 32000
    special = set(tokenizer.special_tokens.values()) if tokenizer is not None else set()
    ordinary = np.setdiff1d(np.arange(min(vocab, 65500)), np.array(sorted(v for v in special if v is not None)))
    dtype = fmt.token_dtype_for_vocab(vocab)
    encoded, info = _images()
    sizes = np.array([len(data) for data in encoded], np.int64)
    count = end - first
    writer = _DatasetWriter(prefix, "multimodal", dtype)
    try:
        for start in range(first, end, CHUNK):
            n = min(CHUNK, end - start)
            lengths = _lengths(start, n, seed)
            owners = np.repeat(np.arange(start, start + n, dtype=np.uint64), lengths)
            places = np.arange(len(owners), dtype=np.uint64) - np.repeat(
                np.cumsum(lengths, dtype=np.uint64) - lengths.astype(np.uint64), lengths)
            mixed = (owners * np.uint64(16) + places + np.uint64(seed)) * np.uint64(0xD1B54A32D192ED03)
            writer.tokens.write(ordinary[(mixed >> np.uint64(33)) % np.uint64(len(ordinary))].astype(dtype))
            kinds = np.arange(start, start + n) % len(encoded)
            writer.images.write(b"".join(encoded[kind] for kind in kinds.tolist()))
        tokens = _write_index(writer.index_file("idx"), dtype, first, end, seed)
        image_bytes = _write_plan(writer.index_file("plan"), first, end, info, sizes)
        meta = {"tokenizer": tokenizer.identity if tokenizer is not None else None,
                "special_tokens": tokenizer.special_tokens if tokenizer is not None else {},
                "sources": ["synthetic"],
                "build": {"source": SOURCE, "synthetic": {"first": first, "end": end, "seed": seed}},
                "counts": {"samples": count, "sequences": count, "tokens": tokens, "views": count,
                           "elements": 2 * count, "images": count, "image_bytes": image_bytes}}
        return writer.publish(meta)
    except BaseException:
        writer.abort()
        raise


def _write_index(out: Any, dtype: np.dtype, first: int, end: int, seed: int) -> int:
    """The Megatron ``.idx`` of samples ``first .. end`` (one sequence each); their token count."""
    count = end - first
    out.write(fmt.MEGATRON_MAGIC + struct.pack("<QBQQ", fmt.MEGATRON_VERSION, fmt.CODE_OF_DTYPE[dtype], count,
                                                count + 1))
    tokens = 0
    for start in range(first, end, CHUNK):
        lengths = _lengths(start, min(CHUNK, end - start), seed)
        out.write(lengths.astype("<i4"))
        tokens += int(lengths.sum(dtype=np.int64))
    pointer = 0
    for start in range(first, end, CHUNK):
        ends = np.cumsum(_lengths(start, min(CHUNK, end - start), seed), dtype=np.int64) * dtype.itemsize + pointer
        out.write(np.concatenate([[pointer], ends[:-1]]).astype("<i8"))
        pointer = int(ends[-1])
    for start in range(0, count + 1, CHUNK):
        out.write(np.arange(start, min(start + CHUNK, count + 1), dtype="<i8"))
    return tokens


def _write_plan(out: Any, first: int, end: int, info: np.ndarray, sizes: np.ndarray) -> int:
    """The ``.plan`` of samples ``first .. end``: one view of two elements and one image each; the image bytes."""
    count = end - first
    shapes = {"sample_view_offsets": (count + 1,), "sample_image_offsets": (count + 1,), "sample_origin": (count, 2),
              "view_element_offsets": (count + 1,), "elements": (2 * count,), "image_offsets": (count + 1,),
              "image_info": (count,)}
    head, entries = fmt.container_layout(fmt.PLAN_MAGIC, {name: (fmt.PLAN_ARRAYS[name], shape)
                                                         for name, shape in shapes.items()})
    out.write(head)
    written = len(head)
    elements = np.array(list(PLAN), dtype=fmt.ELEMENT_DTYPE)
    image_bytes = 0
    for entry in entries:
        out.write(b"\x00" * (entry["offset"] - written))
        name = entry["name"]
        if name.endswith("offsets"):
            out.write(np.zeros(1, "<i8"))
        for start in range(0, count, CHUNK):
            numbers = np.arange(start, min(start + CHUNK, count), dtype=np.int64)  # within this dataset
            if name in ("sample_view_offsets", "sample_image_offsets"):
                out.write((numbers + 1).astype("<i8"))
            elif name == "view_element_offsets":
                out.write((2 * (numbers + 1)).astype("<i8"))
            elif name == "sample_origin":
                out.write(np.stack([np.zeros_like(numbers), numbers + first], axis=1).astype("<i8"))
            elif name == "elements":
                out.write(np.tile(elements, len(numbers)))
            elif name == "image_info":
                out.write(info[(numbers + first) % len(info)])
            else:  # image_offsets: the bytes of every image up to this one's end
                ends = np.cumsum(sizes[(numbers + first) % len(sizes)]) + image_bytes
                out.write(ends.astype("<i8"))
                image_bytes = int(ends[-1])
        written = entry["offset"] + entry["nbytes"]
    return image_bytes
