"""What each pack costs a transformer after CFG dropout, exactly as its batch will be built: :class:`PackCosts`.

The pack index sizes a sample with every element kept; CFG dropout (:mod:`mmidx.index.dropout`) then takes 0-30% of
a multimodal sample's tokens out, drawn per (seed, pack, sample position, element), and BAGEL's model drops those
tokens from the sequence: two packs of the same indexed cost can differ by a sixth after it. Balanced steps deal by
the cost that runs, so the costs here repeat the builder's decisions (the same draws and the one decision,
:func:`~mmidx.index.dropout.cfg_dropped`) on the plan records and the stored image sizes, never reading a text or
decoding an image, and price the kept tokens with the one cost model (:func:`mmidx.index.cost.pack_costs`, a
sample one attention segment).

Costs are computed when asked, for a range of packs (a global batch: a few milliseconds), in numpy: a pure function
of the index, the config and the pack numbers, the same in every process, at every worker count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mmidx import format as fmt
from mmidx.config import DataConfig
from mmidx.index.cost import LLMGeometry, pack_costs
from mmidx.index.dropout import cfg_dropped, sample_uniforms
from mmidx.index.sizes import element_token_counts
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.shards import part_starts

if TYPE_CHECKING:
    from mmidx.index.pack_index import PackIndex

CHUNK_PACKS = 4096  # packs priced at once: bounds the per-element arrays of a long range
CHUNK_ITEMS = 1 << 16  # ... and their samples (a few hundred bytes of temporaries each)


class PackCosts:
    """Each pack's forward FLOPs after CFG dropout: ``costs[first:end]`` (an array), ``len(costs)`` packs.

    Pass it as ``pack_costs`` to :class:`~mmidx.train.loader.PackLoader`, :class:`~mmidx.train.sampler.PackSampler`
    or :class:`~mmidx.train.shares.GlobalBatchSampler`: they price one global batch when they first deal it, so a
    long index costs nothing up front. ``geometry``: the language model's (default Qwen2-7B); ``config``: the data
    config the batches are built with (``PackBuilder(config)``; default the index's), whose seed and dropout
    probabilities decide what each pack drops and whose groups' transforms size its images; ``datasets``: its
    opened datasets (``datasets[g][d]``, e.g. the builder's), else opened from the config.
    """

    def __init__(self, index: PackIndex, geometry: LLMGeometry | None = None, *, config: DataConfig | None = None,
                 datasets: Sequence[Sequence[MMIDXDataset]] | None = None):
        self.index = index
        self.geometry = geometry or LLMGeometry()
        self.config = config or index.config
        self.datasets = [list(group) for group in datasets] if datasets is not None else \
            [[MMIDXDataset(prefix) for prefix in group.datasets] for group in self.config.groups]
        shape = [len(group.datasets) for group in index.config.groups]
        if [len(group) for group in self.datasets] != shape:
            raise ValueError(f"the pack index's groups hold {shape} datasets, the config's or the datasets given "
                             f"{[len(group) for group in self.datasets]}: price an index with its own config")
        self._checked: dict[tuple[int, int], np.ndarray] = {}  # per dataset checked: where each of its parts starts

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, packs: slice) -> np.ndarray:
        if not isinstance(packs, slice):
            raise TypeError(f"PackCosts are read by ranges of packs (costs[first:end]), not {type(packs).__name__}")
        first, end, step = packs.indices(len(self))
        if step != 1:
            raise ValueError("PackCosts are read by contiguous ranges of packs (a step of 1)")
        offsets, parts, start = self.index.arrays["pack_offsets"], [], first
        while start < end:  # at most CHUNK_PACKS packs and (but for one pack) CHUNK_ITEMS samples at once
            stop = min(end, start + CHUNK_PACKS,
                       max(start + 1, int(np.searchsorted(offsets, int(offsets[start]) + CHUNK_ITEMS, "right")) - 1))
            parts.append(pack_costs(*self.sample_tokens(start, stop), self.geometry))
            start = stop
        return np.concatenate(parts) if parts else np.zeros(0)

    def sample_tokens(self, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, tokens) of packs ``first`` … ``end - 1``: their samples' tokens as the builder writes them, CFG
        dropout applied (the batch's ``sample_lens``), pack k's being ``tokens[offsets[k - first]:offsets[k - first
        + 1]]``."""
        index = self.index
        if not 0 <= first <= end <= len(index):
            raise IndexError(f"packs {first}:{end} out of range for {len(index)} packs")
        bounds = np.asarray(index.arrays["pack_offsets"][first:end + 1], dtype=np.int64)
        start, stop = (int(bounds[0]), int(bounds[-1])) if len(bounds) else (0, 0)
        if not 0 <= start <= stop <= len(index.arrays["samples"]) or np.any(np.diff(bounds) < 0):
            raise fmt.FormatError(f"{index.path}: pack_offsets do not rise within the index's samples; delete the "
                                  "cache entry to rebuild it")
        numbers = np.asarray(index.arrays["samples"][start:stop], dtype=np.int64)
        views = np.asarray(index.arrays["views"][start:stop], dtype=np.int64) if "views" in index.arrays \
            else np.zeros_like(numbers)
        starts = index.dataset_starts
        if len(numbers) and (numbers.max() >= starts[-1]):
            raise fmt.FormatError(f"{index.path}: the pack index names samples its datasets do not hold")
        packs = np.repeat(np.arange(first, end, dtype=np.int64), np.diff(bounds))
        positions = np.arange(start, stop, dtype=np.int64) - np.repeat(bounds[:-1], np.diff(bounds))
        owner = np.searchsorted(starts, numbers, side="right") - 1  # the dataset (config order) of each item
        flat = [(g, d) for g, group in enumerate(index.config.groups) for d in range(len(group.datasets))]
        samples, part = numbers - starts[owner], np.zeros(len(numbers), dtype=np.int64)
        for number in np.unique(owner).tolist():  # each item's sample in its dataset, and the part holding it
            g, d = flat[number]
            mine = owner == number
            selection = None if index.selections is None else index.selections[g][d]
            if selection is not None:
                samples[mine] = np.asarray(selection, dtype=np.int64)[samples[mine]]
            part[mine] = self._part_of(g, d, samples[mine])
        order = np.lexsort((part, owner))  # the items dataset by dataset, part by part, in order within each
        runs = np.flatnonzero(np.diff(owner[order]) | np.diff(part[order])) + 1
        parts = []  # per part of a dataset: its items' elements (tokens, kind, flags, place in the view), per item
        for mine in np.split(order, runs) if len(order) else []:
            g, d = flat[int(owner[mine[0]])]
            parts.append(self._elements(g, d, int(part[mine[0]]), samples[mine], views[mine]))
        counts, kinds, flags, places, sizes = (np.concatenate([part[field] for part in parts]) if parts
                                               else np.zeros(0, np.int64) for field in range(5))
        droppable = np.flatnonzero(flags & fmt.FLAG_ENABLE_CFG)  # one draw for the whole range
        uniforms = sample_uniforms(self.config.seed, np.repeat(packs[order], sizes)[droppable],
                                   np.repeat(positions[order], sizes)[droppable], places[droppable])
        counts[droppable[cfg_dropped(kinds[droppable], flags[droppable], uniforms, self.config.dropout)]] = 0
        tokens = np.zeros(len(numbers), dtype=np.int64)
        tokens[order] = _sums(counts, sizes)
        return bounds - start, tokens

    def _part_of(self, g: int, d: int, samples: np.ndarray) -> np.ndarray:
        """The part (shard) of dataset d of group g holding each of its ``samples``, checked to be its samples."""
        dataset = self.datasets[g][d]
        if (g, d) not in self._checked:
            dataset.check_structure()  # the index arrays read below are read unchecked
            self._checked[g, d] = part_starts(dataset)
        if len(samples) and samples.max() >= len(dataset):
            raise fmt.FormatError(f"{self.index.path}: the pack index names sample {int(samples.max())} of "
                                  f"{dataset.prefix}, which holds {len(dataset)}")
        return np.searchsorted(self._checked[g, d], samples, side="right") - 1

    def _elements(self, g: int, d: int, part: int, samples: np.ndarray,
                  views: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The elements of views ``views`` of dataset d of group g's ``samples`` (all in its part ``part``): (their
        packed tokens, kinds, flags, places in their views), and how many each sample's view holds."""
        whole, group = self.datasets[g][d], self.config.groups[g]
        samples = samples - self._checked[g, d][part]
        dataset = whole.parts[part].dataset
        plan = dataset.plan
        if plan is None:  # a text dataset: one view of loss-bearing texts, none of them droppable
            if views.any():
                raise fmt.FormatError(f"{self.index.path}: a view other than 0 of text dataset {whole.prefix}")
            documents = dataset.tokens.document_indices
            elements, sizes = _ranges(documents[samples], documents[samples + 1])
            none = np.zeros(len(elements), dtype=np.int64)
            return dataset.tokens.sequence_lengths[elements].astype(np.int64) + 2, none, none, none, sizes
        view_offsets = plan["sample_view_offsets"]
        if np.any(views >= view_offsets[samples + 1] - view_offsets[samples]):
            raise fmt.FormatError(f"{self.index.path}: the pack index names views of {whole.prefix} its samples "
                                  "do not hold")
        numbers = view_offsets[samples].astype(np.int64) + views
        offsets = plan["view_element_offsets"]
        elements, sizes = _ranges(offsets[numbers], offsets[numbers + 1])
        records = plan["elements"][elements]
        counts = element_token_counts(dataset, group, self.config.geometry, records, np.repeat(samples, sizes))
        places = elements - np.repeat(offsets[numbers].astype(np.int64), sizes)
        return counts, records["kind"].astype(np.int64), records["flags"].astype(np.int64), places, sizes


def _ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the numbers of ranges ``starts[i]:ends[i]`` end to end, each range's size)."""
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    sizes = ends - starts
    first = np.cumsum(sizes) - sizes
    return np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(first - starts, sizes), sizes


def _sums(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The sums of consecutive runs of ``values`` of ``sizes``."""
    cumulative = np.concatenate([[0], np.cumsum(values)])
    ends = np.cumsum(sizes)
    return cumulative[ends] - cumulative[ends - sizes]
