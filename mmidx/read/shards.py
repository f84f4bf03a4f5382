"""A sharded dataset's shards (:mod:`mmidx.format`, format version 2): where each one's samples start, and each
one opened only when it is first read, checked against the table.

A build of thousands of units ends by writing this table instead of copying its shards into one set of files
(:mod:`mmidx.ingest.merge`), so a dataset may have tens of thousands of shards. Opening one maps only its table;
a shard is opened on first use and checked once against the dataset (its metadata's checksum is the table's, its
counts are the table's row, its kind, token dtype, tokenizer and special tokens are the dataset's). How many
datasets stay mapped at once is bounded per process (:mod:`mmidx.read.mapped`), and a mapped file holds no file
descriptor, so any number of shards opens within any descriptor limit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.io.storage import shard_location

# What every shard must share with the dataset it belongs to (the table's metadata).
SHARED_FIELDS = ("kind", "token_dtype", "tokenizer", "special_tokens")


class Part(NamedTuple):
    """One part of a dataset: the samples ``[first_sample, first_sample + len(dataset))`` of the whole, which are
    samples ``0 ..`` of ``dataset`` (a dataset of one set of files; a dataset of one set of files is one part)."""

    first_sample: int
    dataset: Any  # an MMIDXDataset of one set of files


class ShardTable(Sequence[Part]):
    """The shards of the sharded dataset at ``prefix``, as its :class:`Part` s in order.

    ``table`` holds the arrays of ``P.shards.table`` (:func:`mmidx.format.read_shard_table`, checked against
    ``meta``); ``open_shard(prefix, meta_sha256)`` opens one shard (an ``MMIDXDataset`` that refuses metadata
    other than the given checksum), called once per shard, when it is first needed.
    """

    def __init__(self, prefix: str, meta: dict[str, Any], table: dict[str, np.ndarray],
                 open_shard: Callable[[str, str], Any]):
        self.prefix, self.meta, self._open_shard = prefix, meta, open_shard
        self.numbers = table["shard_numbers"]
        self.offsets = table["shard_offsets"]
        self.digests = table["shard_meta_sha256"]
        self.sample_starts = np.ascontiguousarray(self.offsets[:, 0])
        self.sample_count = int(self.sample_starts[-1])
        self._opened: dict[int, Any] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.numbers)

    def __getitem__(self, shard: int) -> Part:  # type: ignore[override]
        if not -len(self) <= shard < len(self):
            raise IndexError(f"shard {shard} out of range for {len(self)} shards")
        shard %= len(self)
        return Part(int(self.sample_starts[shard]), self.shard(shard))

    def __iter__(self) -> Iterator[Part]:
        for shard in range(len(self)):
            yield self[shard]

    def shard_prefix(self, shard: int) -> str:
        """The prefix of shard ``shard`` (its position in the table, not its folder number)."""
        return shard_location(self.prefix, int(self.numbers[shard]))

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard, sample within it) of the dataset's sample ``sample`` (in range: the caller checks)."""
        shard = int(np.searchsorted(self.sample_starts, sample, side="right")) - 1
        return shard, sample - int(self.sample_starts[shard])

    def shard(self, shard: int) -> Any:
        """The opened dataset of shard ``shard``, checked against the table when it is first opened."""
        opened = self._opened.get(shard)
        if opened is not None:
            return opened
        with self._lock:
            opened = self._opened.get(shard)
            if opened is None:
                opened = self._checked(shard)
                self._opened[shard] = opened
        return opened

    def _checked(self, shard: int) -> Any:
        prefix = self.shard_prefix(shard)
        dataset = self._open_shard(prefix, bytes(self.digests[shard]).hex())
        meta = dataset.metadata
        where = f"{self.prefix}: shard {shard} ({prefix})"
        if meta is None:
            raise FormatError(f"{where} has no metadata: the shard was replaced; rebuild the dataset")
        for name in SHARED_FIELDS:
            if meta.get(name) != self.meta.get(name):
                raise FormatError(f"{where}: its {name} is not the dataset's ({meta.get(name)!r} vs "
                                  f"{self.meta.get(name)!r}): corrupted")
        columns = fmt.KIND_COUNTS[self.meta["kind"]]
        expected = (self.offsets[shard + 1] - self.offsets[shard]).tolist()
        counts = [meta["counts"][name] for name in columns]
        if counts != expected:
            raise FormatError(f"{where}: its counts {dict(zip(columns, counts, strict=True))} are not the table's "
                              f"{dict(zip(columns, expected, strict=True))}: {self.prefix}.shards.table is corrupted")
        return dataset

