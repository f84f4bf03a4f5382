"""Search over a dataset's decoded texts, bounded: a slice of samples per request, and it says which.

Texts are stored as token ids, so a search decodes them with the dataset's tokenizer, sample after
sample from where the request starts, until it has scanned ``max_samples`` samples, spent
``max_seconds`` or found ``max_hits`` matches; the result names the samples it scanned, and the
next request continues from there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mmidx.read.dataset import MMIDXDataset

MAX_SAMPLES = 20_000
MAX_SECONDS = 1.0
MAX_HITS = 50


@dataclass
class SearchResult:
    """Matches of one bounded scan: samples ``start`` to ``end`` (exclusive) were scanned."""

    query: str
    start: int
    end: int
    total: int
    seconds: float
    hits: list[tuple[int, str]] = field(default_factory=list)  # (sample, matching text)

    @property
    def complete(self) -> bool:
        """Whether the scan reached the last sample."""
        return self.end >= self.total


def search_texts(dataset: MMIDXDataset, tokenizer: Any, query: str, start: int = 0, *,
                 max_samples: int = MAX_SAMPLES, max_seconds: float = MAX_SECONDS,
                 max_hits: int = MAX_HITS) -> SearchResult:
    """Samples from ``start`` on whose decoded texts contain ``query`` (case-insensitive), within the bounds."""
    needle, total = query.casefold(), len(dataset)
    began = time.perf_counter()
    hits: list[tuple[int, str]] = []
    sample = start = min(max(start, 0), total)
    stop = min(total, start + max_samples)
    while sample < stop and len(hits) < max_hits:
        for ids in dataset[sample].texts:
            text = tokenizer.decode(ids)
            if needle in text.casefold():
                hits.append((sample, text))
                break
        sample += 1
        if sample % 64 == 0 and time.perf_counter() - began > max_seconds:
            break
    return SearchResult(query, start, sample, total, time.perf_counter() - began, hits)
