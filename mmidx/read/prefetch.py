"""Fetching a loader worker's next packs from object storage before it builds them.

Order is a pure function of (config, seed, pack number), so a worker knows the packs it will build
next (:class:`WorkerSchedule`). For each, :class:`PackPrefetcher` computes from the local index the
byte ranges of its samples' tokens and images (a sample's texts are contiguous in ``.bin``, its
images in ``.images``) and of their records in the remote precached-encoding streams opened so far,
sorts and coalesces nearby ranges, and fetches them on the process's thread
pool while the current pack is built, as long as the bytes requested stay under a bound. Reads are
served from those chunks (:class:`mmidx.io.remote_file.RemoteFile`); a pack's chunks are dropped once it is
built. Batches do not depend on any of this: a read that finds no chunk makes its own request.

With a data cache, the chunks are read through it, and the prefetcher tells it the schedule: the steps
ahead and the step being built (:class:`mmidx.read.next_use.NextUse`), by which it evicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mmidx.io.block_cache import BlockCache
from mmidx.io.remote_file import RemoteFile
from mmidx.io.storage import is_remote
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.next_use import Key, NextUse, spans
from mmidx.read.shards import part_starts

# Ranges nearer than GAP are fetched as one request: reading the gap costs less than another request
# while it is under latency x bandwidth (20 ms x ~100 MB/s per connection to S3 ~ 2 MB).
GAP = 2 << 20
MAX_CHUNK = 16 << 20  # the largest single request
DEPTH = 4  # packs fetched ahead of the one being built
MAX_BYTES_IN_FLIGHT = 128 << 20  # bytes requested and not yet dropped, per worker


def coalesce(ranges: Sequence[tuple[int, int]], gap: int = GAP, max_chunk: int = MAX_CHUNK) -> list[tuple[int, int]]:
    """Merged ranges, sorted by start, each range of ``ranges`` inside one of them: neighbours less
    than ``gap`` apart become one, none longer than ``max_chunk`` unless a single range is."""
    merged: list[list[int]] = []
    for start, stop in sorted(ranges):
        if stop <= start:
            continue
        if merged and start - merged[-1][1] < gap and max(stop, merged[-1][1]) - merged[-1][0] <= max_chunk:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(start, stop) for start, stop in merged]


Ranges = tuple[np.ndarray, np.ndarray, np.ndarray]  # starts, stops, and the position in ``samples`` of each


def sample_ranges(dataset: MMIDXDataset, samples: np.ndarray) -> dict[RemoteFile, Ranges]:
    """Byte ranges of the tokens and images of ``samples`` in each remote data file of ``dataset`` (a sharded
    dataset's: in its shards' files, the samples grouped by shard), with the sample (its position in ``samples``)
    each range belongs to.

    Computed from the index arrays; a range that is not inside its file (a corrupted index) is left
    out, for the read that needs it to report."""
    samples = np.asarray(samples, dtype=np.int64)
    if not dataset.is_sharded:
        return _part_ranges(dataset, samples)
    starts = part_starts(dataset)
    owner = np.searchsorted(starts, samples, side="right") - 1
    found: dict[RemoteFile, Ranges] = {}
    for part in np.unique(owner).tolist():
        mine = np.flatnonzero(owner == part)
        for file, (begins, ends, owners) in _part_ranges(dataset.parts[part].dataset,
                                                         samples[mine] - starts[part]).items():
            found[file] = begins, ends, mine[owners]
    return found


def remote_data(dataset: MMIDXDataset) -> dict[str, RemoteFile]:
    """The data files ("bin", "images") of ``dataset`` read by byte range (a sharded dataset's first shard's: its
    shards are read alike, through the same data cache); empty for a local dataset."""
    if not is_remote(dataset.prefix):
        return {}
    return (dataset.parts[0].dataset if dataset.is_sharded else dataset).remote_files


def _part_ranges(dataset: MMIDXDataset, samples: np.ndarray) -> dict[RemoteFile, Ranges]:
    """:func:`sample_ranges` of a dataset of one set of files."""
    remote = dataset.remote_files
    found: dict[RemoteFile, Ranges] = {}
    if not remote:
        return found
    tokens = dataset.tokens
    documents = tokens.document_indices
    first, last = documents[samples], documents[samples + 1]
    nonempty = (0 <= first) & (first < last) & (last <= len(tokens))
    owners = np.flatnonzero(nonempty)
    first, last = first[nonempty], last[nonempty] - 1
    pointers, lengths = tokens.sequence_pointers, tokens.sequence_lengths
    starts = pointers[first]
    stops = pointers[last] + lengths[last].astype(np.int64) * tokens.dtype.itemsize
    found[remote["bin"]] = _inside(starts, stops, owners, len(remote["bin"]))
    if "images" in remote:
        plan = dataset.plan
        image_offsets, numbers = plan["image_offsets"], plan["sample_image_offsets"]
        first, last = numbers[samples], numbers[samples + 1]
        valid = (0 <= first) & (first < last) & (last < len(image_offsets))
        found[remote["images"]] = _inside(image_offsets[first[valid]], image_offsets[last[valid]],
                                          np.flatnonzero(valid), len(remote["images"]))
    found.update(encoding_ranges(dataset, samples))
    return found


def encoding_ranges(dataset: MMIDXDataset, samples: np.ndarray) -> dict[RemoteFile, Ranges]:
    """Byte ranges, in each remote encoding stream the dataset (of one set of files: a shard's streams are its
    own) has opened, of the records of ``samples``' images (or texts): every record keyed by one of their items
    (the records of a sample are contiguous in the sorted table, their values wherever their batch put them)."""
    found: dict[RemoteFile, Ranges] = {}
    for stream in dataset._files.encodings.values():
        if not isinstance(stream.values, RemoteFile):
            continue
        if stream.meta["modality"] == "text":
            numbers = dataset.tokens.document_indices
        elif dataset.plan is not None:
            numbers = dataset.plan["sample_image_offsets"]
        else:
            continue
        first = np.searchsorted(stream.keys, np.asarray(numbers[samples], dtype=np.int64) * 2**32)
        last = np.searchsorted(stream.keys, np.asarray(numbers[samples + 1], dtype=np.int64) * 2**32)
        counts = np.maximum(last - first, 0)
        records = spans(first, counts)
        starts = stream.records["offset"][records].astype(np.int64)
        found[stream.values] = _inside(starts, starts + stream.records["nbytes"][records],
                                       np.repeat(np.arange(len(counts)), counts), len(stream.values))
    return found


def _inside(starts: np.ndarray, stops: np.ndarray, owners: np.ndarray, size: int) -> Ranges:
    keep = (0 <= starts) & (starts < stops) & (stops <= size)
    return starts[keep].astype(np.int64), stops[keep].astype(np.int64), owners[keep]


class PackOrder:
    """The schedule of a pack index read in order by one process: step k trains on pack k."""

    def __init__(self, count: int):
        self.steps = range(count)

    def __call__(self, step: int) -> list[int]:
        return [step]

    def step_of(self, pack: int) -> int | None:
        return pack


class PackPrefetcher:
    """Fetches the bytes of upcoming packs of a pack index over remote datasets (one per worker process).

    ``packs``: anything with ``items(k)``; ``datasets[g][d]``: the datasets the items name; ``schedule``: the
    packs the node trains on at each step (a callable with ``steps`` and ``step_of(pack)``, as
    :class:`mmidx.train.loader.NodeSchedule`; default :class:`PackOrder`), which a data cache evicts by.
    """

    def __init__(self, packs: Any, datasets: Sequence[Sequence[MMIDXDataset]], *, depth: int = DEPTH,
                 max_bytes: int = MAX_BYTES_IN_FLIGHT, schedule: Any = None):
        self.packs, self.datasets = packs, datasets
        self.depth, self.max_bytes = depth, max_bytes
        self.schedule = schedule if schedule is not None else PackOrder(len(packs))
        self._requested: dict[int, tuple[int, list[RemoteFile]]] = {}  # pack -> (bytes, files fetched for it)
        self._policies: dict[BlockCache, NextUse] = {}

    def before(self, pack: int, upcoming: Sequence[int]) -> None:
        """Called before ``pack`` is built: tell the data cache the step it is, fetch it (unless already
        fetched) and as many of the ``upcoming`` packs as fit the byte bound; drop what was fetched for packs
        no longer coming."""
        wanted = [pack, *upcoming[: self.depth]]
        step = self.schedule.step_of(pack)
        front = max((found for number in wanted if (found := self.schedule.step_of(number)) is not None),
                    default=step)
        for policy in self._cache_policies():
            if step is not None:
                policy.at(step, front)
        for stale in set(self._requested) - set(wanted):
            self.after(stale)
        for number in wanted:
            if number in self._requested:
                continue
            if number != pack and sum(size for size, _ in self._requested.values()) >= self.max_bytes:
                break
            self._requested[number] = self._fetch(number)

    def _cache_policies(self) -> list[NextUse]:
        """The eviction policy of each data cache the datasets read through, made once in this process."""
        for group in self.datasets:
            for dataset in group:
                for file in remote_data(dataset).values():
                    cache = file.cache
                    if cache is not None and cache not in self._policies:
                        self._policies[cache] = cache.policy = NextUse(
                            self.packs, self.ranges, self.schedule, self.schedule.steps, self.schedule.step_of,
                            cache.block_size, cache.limit)
        return list(self._policies.values())

    def ranges(self, group: int, number: int, samples: np.ndarray) -> dict[Key, Ranges]:
        """:func:`sample_ranges` of dataset ``number`` of group ``group``, by the cache's key of each file."""
        return {file.key[:2]: ranges for file, ranges in sample_ranges(self.datasets[group][number], samples).items()
                if file.key is not None}

    def after(self, pack: int) -> None:
        """Drop the chunks fetched for ``pack`` (it is built)."""
        _, files = self._requested.pop(pack, (0, []))
        for file in files:
            file.release(pack)

    def _fetch(self, pack: int) -> tuple[int, list[RemoteFile]]:
        by_dataset: dict[tuple[int, int], list[int]] = {}
        for item in self.packs.items(pack):
            by_dataset.setdefault((item.group, item.dataset), []).append(item.sample)
        ranges: dict[RemoteFile, list[tuple[int, int]]] = {}
        for (group, number), samples in by_dataset.items():
            for file, (starts, stops, _) in sample_ranges(self.datasets[group][number], np.array(samples)).items():
                ranges.setdefault(file, []).extend(zip(starts.tolist(), stops.tolist(), strict=True))
        # Through a cache, ranges merge only while no whole block lies between them: the cache then fetches and
        # keeps only blocks packs read, each run of missing ones in one request, and eviction weighs only those.
        size = sum(file.fetch(pack, coalesce(found, GAP if file.cache is None else file.cache.block_size))
                   for file, found in ranges.items())
        return size, list(ranges)


class WorkerSchedule:
    """The packs a DataLoader worker builds after pack ``k``: the sampler hands steps to workers in
    turn, so a worker's next steps are ``workers`` apart. Picklable; called in the worker."""

    def __init__(self, sampler: Any, workers: int, depth: int = DEPTH):
        self.sampler, self.workers, self.depth = sampler, max(1, workers), depth

    def __call__(self, pack: int) -> list[int]:
        step = self.sampler.step_of_pack(pack)
        if step is None:
            return []
        end = min(self.sampler.start + len(self.sampler), step + self.workers * (self.depth + 1))
        return [self.sampler.pack_of_step(later) for later in range(step + self.workers, end, self.workers)]
