"""Where ``mmidx export`` writes each sample: its output file, and the row group it is written in.

An export writes one file per source file of the build, named after it by the layout (``part.parquet`` stays
``part.parquet``, ``shard.tar`` ``shard.tar``), holding that file's samples in dataset order. A file is written
a row group at a time, a group being at most :data:`ROWS` samples and ending once it holds :data:`BYTES` bytes or
more (image bytes, and :data:`TEXT_BYTES` a token of text; the sample that passes it included, so one large sample
is a group of its own). The groups are the
export's tasks. They are counted within each output file, across shards, from the samples alone, so they are the
same whatever the number of workers and whether the dataset is sharded or merged: so are the files.

The plan reads the dataset's ``sample_origin``, image offsets and token counts a part and a chunk of :data:`CHUNK`
samples at a time (vectorised), twice: once to count each file's samples (a file is closed as soon as it is
complete, so a dataset of many source files keeps few open), then lazily, as the export consumes the groups. It
holds O(output files), whatever the number of samples.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from mmidx.format import FormatError
from mmidx.read.dataset import MMIDXDataset

ROWS = 1024  # samples per row group at most
BYTES = 16 << 20  # bytes after which a row group ends (the sample that passes it included)
TEXT_BYTES = 4  # bytes counted for a token of text (its decoded UTF-8, about)
CHUNK = 1 << 20  # samples whose origins and image sizes are read at once
NO_SOURCE = "samples"  # the source file name of samples whose build recorded none


@dataclass(frozen=True)
class OutputFile:
    """One file an export writes: its name in the output folder and how many samples it gets."""

    name: str
    samples: int


@dataclass(frozen=True)
class Group:
    """One row group of an output file: the dataset's samples ``ranges`` ([start, end) pairs, in order), which are
    rows ``first_row ..`` of file number ``file`` (called ``name``); ``last``: the file is complete after it."""

    file: int
    name: str
    first_row: int
    ranges: tuple[tuple[int, int], ...]
    last: bool

    @property
    def size(self) -> int:
        """How many samples the group holds."""
        return sum(end - start for start, end in self.ranges)

    def samples(self) -> Iterator[int]:
        """The dataset's numbers of the group's samples, in row order."""
        for start, end in self.ranges:
            yield from range(start, end)


@dataclass
class _Open:
    """The row group an output file is filling."""

    first_row: int = 0
    rows: int = 0
    size: int = 0  # bytes (images, and TEXT_BYTES a token)
    ranges: list[tuple[int, int]] = field(default_factory=list)

    def add(self, start: int, end: int, size: int) -> None:
        if self.ranges and self.ranges[-1][1] == start:
            self.ranges[-1] = (self.ranges[-1][0], end)
        else:
            self.ranges.append((start, end))
        self.rows += end - start
        self.size += size


class ExportPlan:
    """The output files of ``dataset`` (:attr:`files`, by number) and their row groups (:meth:`groups`);
    ``name_of(source file name)`` is the name of the file its samples go to."""

    def __init__(self, dataset: MMIDXDataset, name_of: Callable[[str], str]):
        self.dataset, self._name_of = dataset, name_of
        self._numbers: dict[str, int] = {}  # output file name → its number
        counts: Counter[int] = Counter()
        for _, numbers, _ in self._chunks(sizes=False):
            found, count = np.unique(numbers, return_counts=True)
            counts.update(dict(zip(found.tolist(), count.tolist(), strict=True)))
        # every name a source list gives, in number order; a file no sample goes to is never written
        self.files = [OutputFile(name, counts[number]) for name, number in self._numbers.items()]

    def _chunks(self, sizes: bool = True) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """(first sample, output file numbers, sizes or None) of each chunk of the dataset's samples."""
        for part in self.dataset.parts:
            plan, meta = part.dataset.plan, part.dataset.metadata or {}
            if plan is None:
                continue
            lookup = self._lookup(meta.get("sources", []))
            origins, image_ends = plan["sample_origin"], plan["image_offsets"]
            for start in range(0, len(part.dataset), CHUNK):
                end = min(start + CHUNK, len(part.dataset))
                sources = np.asarray(origins[start:end, 0])
                numbers = lookup[np.where((sources >= 0) & (sources < len(lookup) - 1), sources, len(lookup) - 1)]
                size = None if not sizes else _sizes(part.dataset, start, end, image_ends)
                yield part.first_sample + start, numbers, size

    def _lookup(self, sources: list[str]) -> np.ndarray:
        """Output file numbers by a part's source index (the last entry: samples with no valid source)."""
        names = [self._name_of(os.path.basename(source) if source else NO_SOURCE) for source in sources]
        names.append(self._name_of(NO_SOURCE))
        return np.array([self._numbers.setdefault(name, len(self._numbers)) for name in names], dtype=np.int64)

    def groups(self) -> Iterator[Group]:
        """Every row group, in the order the dataset completes them (each file's in row order)."""
        filling: dict[int, _Open] = {}
        written = [0] * len(self.files)
        for first, numbers, sizes in self._chunks():
            assert sizes is not None
            cuts = [0, *(np.flatnonzero(np.diff(numbers)) + 1).tolist(), len(numbers)]
            for run_start, run_end in itertools.pairwise(cuts):
                number = int(numbers[run_start])
                ends = np.cumsum(sizes[run_start:run_end])  # bytes up to each sample's end, within the run
                position = run_start
                while position < run_end:
                    group = filling.setdefault(number, _Open(first_row=written[number]))
                    before = int(ends[position - run_start - 1]) if position > run_start else 0
                    # the first sample at which the group's image bytes reach BYTES, if in this run
                    full = int(np.searchsorted(ends, BYTES - group.size + before, side="left")) + run_start
                    end = min(position + ROWS - group.rows, full + 1, run_end)
                    group.add(first + position, first + end, int(ends[end - run_start - 1]) - before)
                    position = end
                    last = written[number] + group.rows == self.files[number].samples
                    if last or group.rows == ROWS or group.size >= BYTES:
                        written[number] += group.rows
                        del filling[number]
                        yield Group(number, self.files[number].name, group.first_row, tuple(group.ranges), last)


def _sizes(dataset: MMIDXDataset, start: int, end: int, image_ends: np.ndarray) -> np.ndarray:
    """The bytes of samples ``start .. end`` of one set of files: their images' and TEXT_BYTES a token of their texts,
    every offset checked before it indexes."""
    sample_images = np.asarray(dataset.plan["sample_image_offsets"][start:end + 1])
    documents = np.asarray(dataset.tokens.document_indices[start:end + 1])
    lengths = dataset.tokens.sequence_lengths
    _check_offsets(f"{dataset.prefix}.plan", "sample_image_offsets", sample_images, len(image_ends) - 1)
    _check_offsets(f"{dataset.prefix}.idx", "document_indices", documents, len(lengths))
    image_bytes = np.asarray(image_ends[sample_images])
    _check_offsets(f"{dataset.prefix}.plan", "image_offsets", image_bytes, image_bytes[-1])
    tokens = np.concatenate([[0], np.cumsum(lengths[documents[0]:documents[-1]], dtype=np.int64)])
    return np.diff(image_bytes) + TEXT_BYTES * np.diff(tokens[documents - documents[0]])


def _check_offsets(path: str, name: str, offsets: np.ndarray, limit: int) -> None:
    if offsets[0] < 0 or offsets.max() > limit or np.diff(offsets).min(initial=0) < 0:
        raise FormatError(f"{path}: {name} leave [0, {limit}] or decrease: corrupted")
