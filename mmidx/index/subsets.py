"""Which samples of a dataset a group uses: BAGEL's ``num_used_data``, ``shuffle_lines``, ``shuffle_seed``.

BAGEL applies them when its datasets start; mmidx applies them when the pack index is built, from
each sample's origin (input file, row), so every sample stays built once and a config change needs
no rebuild. The meaning is BAGEL's:

* ``vlm`` datasets (``SftJSONLIterableDataset.get_data_paths``): the lines of each JSONL file
  (``readlines()``, blank lines included), shuffled with ``random.Random(shuffle_seed).shuffle``
  when ``shuffle_lines``, then the first ``num_used_data`` of them. Counting the lines reads the
  JSONL named in the dataset's metadata (text only, once per index build).
* ``t2i`` and ``edit`` datasets (``get_parquet_data_paths``): ``num_used_data`` parquet files,
  taken in name order (BAGEL takes ``os.listdir``'s order) and cycled when it is larger than the
  number of files, so a file listed twice gives its samples twice.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from mmidx.config import GroupConfig
from mmidx.io.storage import RETRIES, filesystem
from mmidx.read.dataset import MMIDXDataset

_CHUNK = 8 << 20  # bytes of a JSONL read at once
_SAMPLES = 1 << 20  # origins read at once


def used_samples(dataset: MMIDXDataset, group: GroupConfig, position: int) -> np.ndarray | None:
    """The sample numbers dataset ``position`` of ``group`` contributes (rising, repeats allowed); None: all, once.

    Read from each sample's origin a part of the dataset and a chunk at a time (a sharded dataset's sources are
    numbered as in its merge: each shard's after the earlier shards'); the result, 8 bytes a used sample, is the one
    array that grows with the dataset."""
    count = None if group.num_used_data is None else group.num_used_data[position]
    if count is None and not group.shuffle_lines:
        return None
    source = ((dataset.metadata or {}).get("build") or {}).get("source")
    if dataset.kind != "multimodal" or source not in ("vlm", "t2i", "edit"):
        raise ValueError(f"group {group.name!r}: num_used_data and shuffle_lines apply to vlm, t2i and edit datasets "
                         f"(BAGEL's vlm_sft, t2i_pretrain, unified_edit), not to {dataset.prefix} ({source})")
    if source != "vlm" and group.shuffle_lines:
        raise ValueError(f"group {group.name!r}: shuffle_lines applies to vlm datasets only (BAGEL's vlm_sft); "
                         f"{dataset.prefix} is a {source} dataset")
    parts = [(part, part.dataset.metadata.get("sources", [])) for part in dataset.parts]
    files = [name for _, names in parts for name in names]
    if source == "vlm":
        return _selection(parts, _UsedLines(dataset, files, count, group))
    if not files:
        return np.zeros(0, dtype=np.int64)
    times = _file_times(files, count)
    return _selection(parts, lambda sources, rows: times[sources])


def _selection(parts: list[tuple[Any, list[str]]], repeats: Callable[[np.ndarray, np.ndarray], np.ndarray]) \
        -> np.ndarray:
    """Every sample number of the dataset whose ``parts`` (each with its source names) these are, repeated
    ``repeats(sources, rows)`` times: a function of its origin (source, numbered across the parts, or -1; row)."""
    def chunks() -> Iterator[tuple[int, np.ndarray]]:
        base = 0
        for part, names in parts:
            origins = part.dataset.plan["sample_origin"]
            for first in range(0, len(origins), _SAMPLES):
                chunk = np.asarray(origins[first:first + _SAMPLES], dtype=np.int64)
                sources = np.where(chunk[:, 0] >= 0, chunk[:, 0] + base, -1)
                yield part.first_sample + first, np.asarray(repeats(sources, chunk[:, 1]), dtype=np.int64)
            base += len(names)

    selection = np.empty(sum(int(times.sum()) for _, times in chunks()), dtype=np.int64)
    filled = 0
    for first, times in chunks():
        taken = int(times.sum())
        selection[filled:filled + taken] = np.repeat(np.arange(first, first + len(times), dtype=np.int64), times)
        filled += taken
    return selection


class _UsedLines:
    """BAGEL's lines of each JSONL a vlm dataset was built from (``files``, numbered as its origins are): shuffled
    when ``shuffle_lines``, then the first ``count``; called with origins, whether each sample's line is used. Each
    file's lines are counted once, however many parts of the dataset it is listed in."""

    def __init__(self, dataset: MMIDXDataset, files: list[str], count: int | None, group: GroupConfig):
        self.dataset, self.files, self.count, self.group = dataset, files, count, group
        self.used: dict[str, np.ndarray] = {}

    def lines(self, location: str) -> np.ndarray:
        used = self.used.get(location)
        if used is None:
            lines = list(range(line_count(location, self.group)))
            if self.group.shuffle_lines:
                random.Random(self.group.shuffle_seed).shuffle(lines)
            used = self.used[location] = np.zeros(len(lines), dtype=bool)
            used[lines[:self.count]] = True
        return used

    def __call__(self, sources: np.ndarray, rows: np.ndarray) -> np.ndarray:
        keep = np.zeros(len(sources), dtype=bool)
        for number in np.unique(sources[sources >= 0]).tolist():
            location = self.files[number]
            used, of_file = self.lines(location), sources == number
            mine = rows[of_file]
            if mine.max() >= len(used):
                raise ValueError(f"{location} has {len(used)} lines but {self.dataset.prefix} holds a sample of line "
                                 f"{int(mine.max())}: the file changed after the build; rebuild the dataset")
            keep[of_file] = used[mine]
        return keep


def _file_times(files: list[str], count: int) -> np.ndarray:
    """How many times BAGEL lists each of ``files``: ``count`` of them, in name order, cycled."""
    by_name = sorted(range(len(files)), key=files.__getitem__)
    times = np.zeros(len(files), dtype=np.int64)
    for slot in range(count):
        times[by_name[slot % len(files)]] += 1
    return times


def line_count(location: str, group: GroupConfig) -> int:
    """Lines of a text file as Python's ``readlines()`` counts them (a last line without newline counts)."""
    fs, path = filesystem(location, attempts=RETRIES)  # a streaming read: pyarrow retries a failed request
    lines, last = 0, b"\n"
    try:
        with fs.open_input_stream(path) as stream:
            while chunk := stream.read(_CHUNK):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except (OSError, FileNotFoundError) as error:
        raise ValueError(f"group {group.name!r}: shuffle_lines and num_used_data count the lines of {location}, "
                         f"the JSONL the dataset was built from, and it cannot be read: {error}") from error
    return lines + (last != b"\n")
