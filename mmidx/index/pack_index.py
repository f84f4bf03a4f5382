"""The multimodal pack index of a data config: which samples (and views) make pack k.

Built once per job from the datasets' index arrays alone, never decoding an image:

1. every view's exact packed size (BAGEL's ``num_tokens + 2 × len(plan)``): text lengths from the
   token index, image token counts from the probed sizes and the group's transforms;
2. the blended, shuffled stream of (group, sample, epoch) (:func:`mmidx.index.stream.multimodal_stream`):
   epoch e of a sample reads its view ``e mod views`` (recorded per packed item);
3. packs of whole samples within the budgets (:func:`mmidx.index.packer.pack_samples`).

Steps 2 and 3 run a chunk of the stream at a time (:class:`mmidx.index.pack_stream.PackStream`), each chunk's
packs appended to the cache files as they close, so memory is bounded by the chunk size, not by
``num_samples``. The cache (:mod:`mmidx.index.cache`) keeps only what a reader needs: which samples make
each pack and which view each reads, a few bytes per sample; it is keyed by a hash of the config,
the requested size and every dataset's checksum, and mapped in O(1); under ``torch.distributed``
rank 0 builds it.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from mmidx import _packing
from mmidx import format as fmt
from mmidx.config import DataConfig
from mmidx.errors import option
from mmidx.index.cache import ArraySink, cached_build
from mmidx.index.cost import LLMGeometry
from mmidx.index.history import MixtureHistory
from mmidx.index.identity import StreamIdentity
from mmidx.index.pack_costs import PackCosts
from mmidx.index.pack_stream import PackStream
from mmidx.index.schedule import Phase
from mmidx.index.sizes import view_table
from mmidx.index.stream import ViewTable
from mmidx.index.subsets import used_samples
from mmidx.read.dataset import MMIDXDataset

# 3: a schedule of one phase blends by that phase's weights (2 took the groups' weight keys instead)
# 4: a blend of one phase normalises its weights once, as a schedule's phases (3 did twice: the last bits of
#    the weights differed, so did ties of the blend, and a run edited at a resume was not the packs it trained)
INDEX_VERSION = 4


def _unsigned(bound: int) -> np.dtype:
    """The narrowest unsigned dtype holding every value up to ``bound``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if bound <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


@dataclass
class PackIndex:
    """Loaded (memory-mapped) pack index: ``len()`` packs, ``items(k)`` → the samples of pack k.

    Pack k is items ``pack_offsets[k]:pack_offsets[k + 1]`` of ``samples`` (numbered across every
    dataset of every group, in config order) and ``views`` (absent when every sample has one view).
    """

    config: DataConfig
    arrays: dict[str, np.ndarray]
    stats: dict[str, Any]
    dataset_starts: np.ndarray  # first sample number of each dataset, then the total
    path: Path | None = None
    reused: bool = False
    selections: list[list[np.ndarray | None]] | None = None  # per group and dataset: used samples (None: all)
    identity: StreamIdentity | None = None  # the stream's, for loader states (None: an index built by hand)

    def __post_init__(self) -> None:
        sizes = [len(g.datasets) for g in self.config.groups]
        self.dataset_starts = np.ascontiguousarray(self.dataset_starts, dtype=np.int64)
        self._group = np.repeat(np.arange(len(sizes)), sizes).astype(np.int64)
        self._dataset = np.concatenate([np.arange(n) for n in sizes]).astype(np.int64)
        if len(self._group) != len(self.dataset_starts) - 1:
            raise ValueError("dataset_starts needs one entry per dataset of the config, then the total")
        # Raw little-endian bytes of each array (dtypes are narrow and differ from index to index).
        raw: list[Any] = []
        for name in ("pack_offsets", "samples", "views"):
            array = self.arrays.get(name)
            if array is None:
                raw += [np.zeros(1, np.uint8), 0]
                continue
            dtype = array.dtype.newbyteorder("<")
            if array.dtype.kind != "u" or array.ndim != 1 or array.dtype != dtype:
                raise fmt.FormatError(f"{self.path}: {name} is {array.dtype} of {array.ndim} dimensions, expected "
                                      "little-endian unsigned integers in one dimension")
            raw += [np.asarray(array).view(np.uint8) if array.size else np.zeros(1, np.uint8), array.dtype.itemsize]
        self._reader = _packing.PackReader(*raw, self.dataset_starts, self._group, self._dataset, PackItem)

    def __len__(self) -> int:
        return len(self.arrays["pack_offsets"]) - 1

    def __repr__(self) -> str:  # not the dataclass's, which would print every memory-mapped array whole
        where = "in memory" if self.path is None else f"{self.path}{' (reused)' if self.reused else ''}"
        groups = ", ".join(group.name for group in self.config.groups)
        return (f"PackIndex({len(self):,} pack{'s' if len(self) != 1 else ''}, "
                f"{len(self.arrays['samples']):,} items, groups {groups}, {where})")

    def items(self, pack: int) -> list[PackItem]:
        """The samples of pack ``pack`` in packing order, each with the view its epoch reads."""
        if not 0 <= pack < len(self):
            raise IndexError(f"pack {pack} out of range for {len(self)} packs")
        items = self._reader.items(pack)
        if isinstance(items, str):
            raise fmt.FormatError(f"{self.path}: {items}; delete the cache entry to rebuild it")
        if self.selections is not None:  # the stream numbers a dataset's used samples: map them back
            items = [item if (chosen := self.selections[item.group][item.dataset]) is None
                     else item._replace(sample=int(chosen[item.sample])) for item in items]
        return items


def build_pack_index(config: DataConfig | MixtureHistory, *, num_samples: int | None = None,
                     cache_dir: str | os.PathLike | None = None, progress: bool = True,
                     chunk_size: int = 1 << 20) -> PackIndex:
    """Build (or load from ``cache_dir``) the pack index of ``config``, or of a run's mixture history (the
    configs in force from the packs where each took over: :mod:`mmidx.index.history`).

    ``num_samples``: stream length (samples drawn across all groups and epochs); default: the
    total number of samples of all groups, i.e. about one epoch (of a history: of its first config's
    groups, so that a group added at a resume leaves the stream's length, and so the packs consumed,
    alone). Cached arrays are reused only if the config, the size and every dataset are unchanged. The
    stream is packed ``chunk_size`` samples at a time (memory is bounded by it); ``progress`` shows a bar
    on stderr for builds longer than 2 s and a line when a cache entry is reused (``PackIndex.reused``
    says it too).
    """
    history = config if isinstance(config, MixtureHistory) else MixtureHistory.of(config)
    config = history.config
    datasets = [[MMIDXDataset(prefix) for prefix in group.datasets] for group in config.groups]
    selections = [[used_samples(d, group, k) for k, d in enumerate(group_datasets)]
                  for group, group_datasets in zip(config.groups, datasets, strict=True)]
    sizes = [[len(d) if s is None else len(s) for d, s in zip(group, selected, strict=True)]
             for group, selected in zip(datasets, selections, strict=True)]
    group_sizes = [sum(group) for group in sizes]
    if min(group_sizes) == 0:
        empty = {g.name: g.datasets for g, n in zip(config.groups, group_sizes, strict=True) if n == 0}
        raise ValueError(f"groups {empty} have no samples")
    if num_samples is None:  # a history keeps the stream its run started with (groups added later: more epochs)
        num_samples = sum(group_sizes[:len(history.takeovers[0][1].groups)])
    num_samples = int(num_samples)
    if num_samples < 0:
        raise ValueError(f"num_samples must be non-negative, got {num_samples}")
    dataset_starts = np.concatenate([[0], np.cumsum([n for group in sizes for n in group])]).astype(np.int64)
    checksums = [[d.checksum for d in group] for group in datasets]
    _check_duplicates(config, checksums)
    description = {"kind": "pack_index", "version": INDEX_VERSION, "config": config.describe(),
                   "num_samples": num_samples, "datasets": checksums}
    if len(history.takeovers) > 1:  # absent for a run of one config: its cache key is as before
        description["history"] = history.describe()

    def build(sink: ArraySink) -> dict[str, Any]:
        return write_pack_index(sink, view_table(config, datasets, selections), config, num_samples,
                                chunk_size=chunk_size, progress=progress, phases=history.phases())

    arrays, stats, folder, reused = cached_build(cache_dir, description, build)
    if progress and reused:  # a build says so with its progress bar
        print(f"mmidx: pack index reused from {folder}", file=sys.stderr)
    used = selections if any(s is not None for group in selections for s in group) else None
    identity = StreamIdentity(history, num_samples, tuple(tuple(group) for group in checksums), INDEX_VERSION)
    return PackIndex(config, arrays, stats, dataset_starts, folder, reused, used, identity)


def _check_duplicates(config: DataConfig, checksums: list[list[str]]) -> None:
    """Refuse a dataset (by checksum) in two groups or twice in one, unless the config allows duplicates."""
    if config.allow_duplicates:
        return
    seen: dict[str, str] = {}
    for group, group_checksums in zip(config.groups, checksums, strict=True):
        for prefix, checksum in zip(group.datasets, group_checksums, strict=True):
            if checksum in seen:
                raise ValueError(f"dataset {prefix} (group {group.name!r}) has the same checksum as {seen[checksum]}: "
                                 "its samples would be drawn twice as often; list it once, or set "
                                 "allow_duplicates: true in the data config if that is meant")
            seen[checksum] = f"{prefix} (group {group.name!r})"


def write_pack_index(sink: ArraySink, table: ViewTable, config: DataConfig, num_samples: int, *,
                     chunk_size: int = 1 << 20, progress: bool = False,
                     phases: list[Phase] | None = None) -> dict[str, Any]:
    """Pack ``num_samples`` of the blended stream over ``table`` and append the packs to ``sink``
    (``pack_offsets``, ``samples`` and, with more than one view to a sample, ``views``, each in
    the narrowest unsigned dtype for this table and size); returns the stats. ``phases``: the
    schedule (default: the config's own, see :meth:`DataConfig.phase_weights`)."""
    start = time.perf_counter()
    packing = config.packing
    if phases is None:
        phases = [Phase(tuple(w), p, t) for w, p, t in config.phase_weights()]
    plain = len(phases) == 1 and min(phases[0].weights) > 0  # today's one blend: weights checked as before
    stream = PackStream(table, list(phases[0].weights), num_samples, config.seed,
                        mandatory=[g.is_mandatory for g in config.groups], max_num_tokens=packing.max_num_tokens,
                        expected_num_tokens=packing.expected_num_tokens,
                        max_num_tokens_per_sample=packing.max_num_tokens_per_sample,
                        prefer_buffer_before=packing.prefer_buffer_before, max_buffer_size=packing.max_buffer_size,
                        chunk_size=chunk_size, phases=None if plain else phases, policy=packing.policy,
                        window=packing.window, cost_slack=packing.cost_slack)
    # with several phases, packs may also hold mandatory items taken ahead of a phase that then ended (each
    # mandatory group delivers at most num_samples items: PackStream)
    mandatory = sum(g.is_mandatory for g in config.groups) if len(phases) > 1 else 0
    sink.declare("pack_offsets", _unsigned(num_samples * (1 + mandatory)))
    sink.declare("samples", _unsigned(int(table.group_base[-1]) - 1))
    keep_views = table.max_views > 1
    if keep_views:
        sink.declare("views", _unsigned(table.max_views - 1))
    item_bytes = sum(sink.dtypes[name].itemsize for name in ("samples", "views") if name in sink.dtypes)
    total = int(table.group_base[-1])
    sink.require_room(num_samples * item_bytes, f"a pack index of {num_samples:,} samples (about "
                      f"{num_samples / total:,.0f} epochs of the config's {total:,})",
                      f"ask for fewer ({option('num_samples')} counts the samples drawn, not tokens or steps)")
    sink.append("pack_offsets", np.zeros(1, np.int64))
    items = packs = tokens = 0
    with tqdm(total=num_samples, unit=" samples", unit_scale=True, delay=2, file=sys.stderr,
              disable=not progress, desc="building pack index") as bar:
        for chunk in stream:
            sink.append("pack_offsets", chunk.pack_ends + items)
            sink.append("samples", chunk.samples)
            if keep_views:
                sink.append("views", chunk.views)
            items += len(chunk.samples)
            packs += len(chunk.pack_ends)
            tokens += chunk.tokens
            bar.update(chunk.stream_position - bar.n)
            if packs:
                fill = tokens / packs / packing.max_num_tokens
                bar.set_postfix(packs=f"{packs:,}", fill=f"{fill:.3f}", refresh=False)
    mixture = {} if plain else {"mixture": mixture_log(stream, config, phases)}
    return {**stream.stats, "samples": num_samples,
            "groups": {g.name: n for g, n in zip(config.groups, stream.group_counts, strict=True)},
            "tokens": tokens, "build_seconds": round(time.perf_counter() - start, 3), **mixture}


def mixture_log(stream: PackStream, config: DataConfig, phases: list[Phase]) -> list[dict[str, Any]]:
    """Per phase the stream actually ran: where it started (stream position, pack), the requested weights
    and the items and tokens each group took (stored in the stats for ``mmidx index --mixture``). A phase
    whose limit had passed before it began (one a later config of a history cut short) is left out."""
    names = [g.name for g in config.groups]
    return [{"phase": log["phase"], "start_position": log["start_position"], "end_position": log["end_position"],
             "start_pack": log["start_pack"], "until_packs": phases[log["phase"]].until_packs,
             "until_tokens": phases[log["phase"]].until_tokens,
             "weights": dict(zip(names, phases[log["phase"]].weights, strict=True)),
             "items": dict(zip(names, log["items"].tolist(), strict=True)),
             "tokens": dict(zip(names, log["tokens"].tolist(), strict=True))}
            for log in stream.phase_log if log["end_position"] > log["start_position"] or len(stream.phase_log) == 1]


def pack_index_costs(index: PackIndex, geometry: LLMGeometry | None = None) -> np.ndarray:
    """Every pack's compute after CFG dropout, as its batch will be built (:class:`~mmidx.index.pack_costs.PackCosts`
    of the whole index, priced now): pass it, or the ``PackCosts`` that prices a global batch when it is dealt, as
    ``pack_costs`` to the loader or sampler for balanced steps."""
    return PackCosts(index, geometry)[:]


class PackItem(NamedTuple):
    """One sample of a pack: which group, dataset, sample and view (a named tuple, which the pack
    index's kernel makes without a Python call per item: ``items(k)`` is a few µs)."""

    group: int
    dataset: int
    sample: int
    view: int
