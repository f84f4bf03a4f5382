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

import numpy as np

from mmidx.config import GroupConfig
from mmidx.io.storage import RETRIES, filesystem
from mmidx.read.dataset import MMIDXDataset

_CHUNK = 8 << 20


def used_samples(dataset: MMIDXDataset, group: GroupConfig, position: int) -> np.ndarray | None:
    """The sample numbers dataset ``position`` of ``group`` contributes (repeats allowed); None: all, once."""
    count = None if group.num_used_data is None else group.num_used_data[position]
    if count is None and not group.shuffle_lines:
        return None
    source = ((dataset.metadata or {}).get("build") or {}).get("source")
    if dataset.plan is None or source not in ("vlm", "t2i", "edit"):
        raise ValueError(f"group {group.name!r}: num_used_data and shuffle_lines apply to vlm, t2i and edit datasets "
                         f"(BAGEL's vlm_sft, t2i_pretrain, unified_edit), not to {dataset.prefix} ({source})")
    files = dataset.metadata.get("sources", [])
    origins = np.asarray(dataset.plan["sample_origin"])
    if source == "vlm":
        return _used_lines(dataset, files, origins, count, group)
    if group.shuffle_lines:
        raise ValueError(f"group {group.name!r}: shuffle_lines applies to vlm datasets only (BAGEL's vlm_sft); "
                         f"{dataset.prefix} is a {source} dataset")
    return _used_files(files, origins, count)


def selected_views(offsets: np.ndarray, tokens: np.ndarray, selection: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(view_offsets, view_tokens) of the samples ``selection`` (in that order, repeats allowed), from
    those of every sample (:func:`mmidx.index.sizes.view_token_counts`)."""
    counts = np.diff(offsets)[selection]
    selected = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    views = np.repeat(offsets[:-1][selection] - selected[:-1], counts) + np.arange(selected[-1])
    return selected, tokens[views]


def _used_lines(dataset: MMIDXDataset, files: list[str], origins: np.ndarray, count: int | None,
                group: GroupConfig) -> np.ndarray:
    keep = np.zeros(len(origins), dtype=bool)
    for number, location in enumerate(files):
        lines = list(range(line_count(location, group)))
        if group.shuffle_lines:
            random.Random(group.shuffle_seed).shuffle(lines)
        used = np.zeros(len(lines), dtype=bool)
        used[lines[:count]] = True
        of_file = origins[:, 0] == number
        rows = origins[of_file, 1]
        if len(rows) and rows.max() >= len(used):
            raise ValueError(f"{location} has {len(used)} lines but {dataset.prefix} holds a sample of line "
                             f"{int(rows.max())}: the file changed after the build; rebuild the dataset")
        keep[of_file] = used[rows]
    return np.flatnonzero(keep)


def _used_files(files: list[str], origins: np.ndarray, count: int) -> np.ndarray:
    if not files:
        return np.zeros(0, dtype=np.int64)
    by_name = sorted(range(len(files)), key=files.__getitem__)
    times = np.zeros(len(files), dtype=np.int64)
    for slot in range(count):
        times[by_name[slot % len(files)]] += 1
    return np.repeat(np.arange(len(origins)), times[origins[:, 0]])


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
