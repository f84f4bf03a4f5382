"""A pack's precached records gathered into its batch buffer: located and checked per stream in one vectorised
pass, then copied from the stream's mapped ``.bin`` in one call (:mod:`mmidx._gather`, streaming stores).

Building a pack records each precached record it uses as a :class:`PackRecord` (no lookup, no tensor view);
the batch's assembly then finds every record of a stream with one ``searchsorted``, applies the reader's
checks (:meth:`~mmidx.read.encoding_streams.EncodingStream.view`'s) to all of them at once, and copies them
where they go. A record that fails is read again by the one-record path, which raises its own error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from mmidx import _gather
from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.io.remote_file import RemoteFile
from mmidx.read.encoding_streams import MAX_DIM, EncodingStream, stream_location


class PackRecord(NamedTuple):
    """One precached record a pack uses: the stream, the record's (item, img_num) key, and the size the pack
    gives the image (ViT: its patch grid (h, w); VAE: its (height, width) in pixels and the latent patch)."""

    stream: EncodingStream
    item: int
    img_num: int
    size: tuple[int, ...]


def _by_stream(records: Sequence[PackRecord]) -> dict[int, list[int]]:
    """The positions of ``records`` per stream (by identity), in order."""
    groups: dict[int, list[int]] = {}
    for position, record in enumerate(records):
        groups.setdefault(id(record.stream), []).append(position)
    return groups


def record_problems(stream: EncodingStream, rows: np.ndarray) -> np.ndarray:
    """Per table record of ``stream`` in ``rows``: whether :meth:`EncodingStream.view` refuses it (its shape,
    size and offset against the ``.bin``), for all at once."""
    ndim = rows["ndim"].astype(np.int64)
    dims = rows["shape"].astype(np.int64)
    used = np.arange(4) < ndim[:, None]  # the dimensions a record of 1 to 4 dimensions has
    # float64 is exact below 2**53, and a product at or above it cannot equal a size that fits the .bin
    size = np.prod(np.where(used, dims, 1), axis=1, dtype=np.float64) * stream.itemsize
    offset, nbytes = rows["offset"], rows["nbytes"]
    return ((ndim < 1) | (ndim > 4) | np.any(used & (dims < 0), axis=1) | np.any(used & (dims > MAX_DIM), axis=1)
            | (nbytes != size) | (offset < 0) | (offset % fmt.ENCODING_ALIGNMENT != 0)
            | (nbytes < 0) | (offset > len(stream.values) - nbytes))


def table_rows(records: Sequence[PackRecord]) -> tuple[np.ndarray, np.ndarray]:
    """The table records (``ENCODING_RECORD``) of ``records`` and their numbers in their streams, in order, each
    found and checked as :meth:`EncodingStream.tensor` finds and checks one (FormatError with its message)."""
    rows = np.empty(len(records), fmt.ENCODING_RECORD)
    numbers = np.empty(len(records), np.int64)
    for positions in _by_stream(records).values():
        stream = records[positions[0]].stream
        keys = np.array([records[p].item * 2**32 + records[p].img_num for p in positions], np.int64)
        found = np.minimum(stream.keys.searchsorted(keys), max(len(stream.keys) - 1, 0))
        missing = (stream.keys[found] != keys) if len(stream.keys) else np.ones(len(keys), bool)
        if missing.any():
            record = records[positions[int(missing.argmax())]]
            stream.tensor(record.item, record.img_num)  # raises: no record
        rows[positions], numbers[positions] = stream.records[found], found
        bad = record_problems(stream, stream.records[found])
        if bad.any():
            stream.view(int(found[bad.argmax()]))  # raises the reader's message
            raise FormatError(f"{stream_location(stream.prefix, stream.name, 'idx')}: record {found[bad.argmax()]} "
                              "does not fit its .bin: corrupted")
    return rows, numbers


def same_dtype(records: Sequence[PackRecord], dtype: torch.dtype) -> bool:
    """Whether every record's stream stores ``dtype`` (so that records copy as bytes)."""
    return all(stream.dtype == dtype for stream in {id(record.stream): record.stream for record in records}.values())


def copy_into(out: torch.Tensor, records: Sequence[PackRecord], rows: np.ndarray, destinations: np.ndarray,
              planes: np.ndarray, lines: np.ndarray, line_bytes: np.ndarray, plane_stride: int = 0,
              line_stride: int = 0) -> None:
    """Copy each record's stored bytes into the contiguous CPU tensor ``out``, at byte ``destinations[i]``, as
    ``planes[i]`` x ``lines[i]`` runs of ``line_bytes[i]`` bytes at the given byte strides (one run: the record
    packed; more: the top-left corner of a padded slot); one kernel call per stream (per record if remote)."""
    target = out.reshape(-1).view(torch.uint8).numpy()
    arrays = destinations, planes, lines, line_bytes
    for positions in _by_stream(records).values():
        values = records[positions[0]].stream.values
        chosen = np.asarray(positions)
        offsets = np.ascontiguousarray(rows["offset"][chosen])
        if isinstance(values, RemoteFile):  # one ranged read (or a prefetched chunk) per record
            for index, offset, nbytes in zip(chosen, offsets.tolist(), rows["nbytes"][chosen].tolist(), strict=True):
                _gather.copy_records(values[offset:offset + nbytes], np.zeros(1, np.int64), target,
                                     *(array[index:index + 1] for array in arrays), plane_stride, line_stride)
        else:
            _gather.copy_records(values, offsets, target, *(np.ascontiguousarray(array[chosen]) for array in arrays),
                                 plane_stride, line_stride)


def record_views(records: Sequence[PackRecord], numbers: np.ndarray) -> list[torch.Tensor]:
    """The stored values of ``records`` as tensors (for records that must change dtype on their way)."""
    return [record.stream.view(int(number)) for record, number in zip(records, numbers, strict=True)]
