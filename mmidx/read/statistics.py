"""Statistics of index arrays in one streaming pass: a part of a dataset and a chunk of entries at a time.

``mmidx inspect`` and the viewer's overview describe distributions (tokens per sample, image sizes, ...) of
arrays as long as the dataset. Nothing here copies a whole array: each is read ``CHUNK`` entries at a time, a
part (shard) at a time, into a :class:`Distribution` that keeps the distinct values and how often each occurs.
Its memory is the number of distinct values (bounded by the values' range: token counts, pixels, bytes of an
image), not the number of samples, and the result does not depend on how the values were cut into chunks or
shards, so a sharded dataset and its merge give the same statistics.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from mmidx.read.dataset import MMIDXDataset

CHUNK = 1 << 20  # entries of an index array read at once


class Distribution:
    """The distinct values seen so far (sorted, int64) and their counts, merged a chunk at a time."""

    def __init__(self) -> None:
        self.values = np.empty(0, np.int64)
        self.counts = np.empty(0, np.int64)
        self.total = 0  # the exact sum of every value added

    def add(self, chunk: np.ndarray) -> None:
        """Count the integer values of ``chunk``."""
        values, counts = np.unique(np.asarray(chunk).astype(np.int64, copy=False), return_counts=True)
        self.total += int(values @ counts) if len(values) else 0
        if len(self.values):
            values, where = np.unique(np.concatenate([self.values, values]), return_inverse=True)
            merged = np.zeros(len(values), np.int64)
            np.add.at(merged, where, np.concatenate([self.counts, counts]))
            counts = merged
        self.values, self.counts = values, counts.astype(np.int64, copy=False)

    @property
    def count(self) -> int:
        """How many values were added."""
        return int(self.counts.sum())

    def percentile(self, q: float) -> float:
        """The q-th percentile as ``numpy.percentile``'s default (linear) method gives it on every value."""
        n = self.count
        where = (q / 100) * (n - 1)
        below = int(np.floor(where))
        above = min(below + 1, n - 1)
        ends = np.cumsum(self.counts)
        a, b = (float(self.values[np.searchsorted(ends, rank, "right")]) for rank in (below, above))
        t = where - below
        return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t

    def stats(self) -> dict[str, float]:
        """count, min, mean (2 decimals), p50, p99 and max, or just the count 0."""
        count = self.count
        if count == 0:
            return {"count": 0}
        return {"count": count, "min": float(self.values[0]), "mean": round(self.total / count, 2),
                "p50": self.percentile(50), "p99": self.percentile(99), "max": float(self.values[-1])}


def chunks(array: np.ndarray) -> Iterator[np.ndarray]:
    """``array`` as consecutive views of at most ``CHUNK`` entries (none copied)."""
    for start in range(0, len(array), CHUNK):
        yield array[start:start + CHUNK]


def differences(offsets: np.ndarray) -> Iterator[np.ndarray]:
    """``np.diff(offsets)`` a chunk at a time (each chunk of offsets overlapping the next by one)."""
    for start in range(0, max(len(offsets) - 1, 0), CHUNK):
        yield np.diff(offsets[start:start + CHUNK + 1])


def sample_token_counts(part: MMIDXDataset) -> Iterator[np.ndarray]:
    """Tokens of each sample of one set of files (all its texts), int64, a chunk of samples at a time, from
    the token index alone; needs a checked structure."""
    tokens = part.tokens
    lengths, documents = tokens.sequence_lengths, tokens.document_indices
    for start in range(0, max(len(documents) - 1, 0), CHUNK):
        bounds = documents[start:start + CHUNK + 1].astype(np.int64)
        first = int(bounds[0])
        cumulative = np.concatenate([[0], np.cumsum(lengths[first:int(bounds[-1])], dtype=np.int64)])
        yield np.diff(cumulative[bounds - first])


def add_bincount(total: np.ndarray | None, codes: np.ndarray, minlength: int) -> np.ndarray:
    """``total`` plus the bincount of ``codes`` (each at least ``minlength`` long, the longer one's length)."""
    counts = np.bincount(codes.astype(np.int64, copy=False), minlength=minlength)
    if total is None:
        return counts
    if len(total) < len(counts):
        total, counts = counts, total
    total = total.copy()
    total[:len(counts)] += counts
    return total
