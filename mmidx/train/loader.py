"""torch integration: a map-style dataset of packs and a resumable loader of one rank's share of them.

Order is a pure function of (config, seed, pack number): pack k is the same batch in any process,
worker or run; which rank trains it at which micro-step is :mod:`mmidx.train.shares`'. The resume
state is the packs consumed so far, with the shares it was saved with and the stream's identity
(:mod:`mmidx.train.state`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mmidx.index.identity import StreamIdentity
from mmidx.index.pack_costs import PackCosts
from mmidx.index.pack_index import PackItem
from mmidx.pack.batch import PackedBatch
from mmidx.pack.builder import PackBuilder
from mmidx.read.prefetch import PackPrefetcher, WorkerSchedule, remote_data
from mmidx.train.shares import GlobalBatchSampler, NodeSchedule
from mmidx.train.state import OwnStream, state_after, steps_of_state


class PackDataset(torch.utils.data.Dataset):
    """Pack k → :class:`PackedBatch` (CPU tensors, split metadata instead of masks).

    ``packs`` is anything with ``len()`` and ``items(k) -> list[PackItem]``
    (a :class:`~mmidx.index.pack_index.PackIndex`).
    ``upcoming`` (set by :class:`PackLoader`): pack k -> the packs this worker builds next, whose bytes
    are fetched ahead from datasets in object storage (:mod:`mmidx.read.prefetch`); ``schedule`` (set by
    it too): the packs this node trains on at each step (:class:`NodeSchedule`), which a data cache evicts by.
    """

    def __init__(self, packs: Any, builder: PackBuilder):
        self.packs = packs
        self.builder = builder
        self.upcoming: Callable[[int], list[int]] | None = None
        self.schedule: NodeSchedule | None = None
        self._prefetcher: PackPrefetcher | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_prefetcher": None}  # each worker fetches for itself

    def __len__(self) -> int:
        return len(self.packs)

    @property
    def identity(self) -> StreamIdentity | None:
        """The packs' stream identity, which loader states carry (None: packs that are no pack index)."""
        return getattr(self.packs, "identity", None)

    def __getitem__(self, index: int) -> PackedBatch:
        items: Sequence[PackItem] = self.packs.items(index)
        if not any(remote_data(dataset) for group in self.builder.datasets for dataset in group):
            return self.builder.build(index, items)
        if self._prefetcher is None:
            self._prefetcher = PackPrefetcher(self.packs, self.builder.datasets, schedule=self.schedule)
        self._prefetcher.before(index, self.upcoming(index) if self.upcoming else [])
        try:
            return self.builder.build(index, items)
        finally:
            self._prefetcher.after(index)


def collate_pack(batch: list[PackedBatch]) -> PackedBatch:
    """DataLoader collate for one pack per micro-batch (BAGEL's batch_size=1)."""
    if len(batch) != 1:
        raise ValueError(f"a micro-batch is one pack; use DataLoader(batch_size=1), got {len(batch)}")
    return batch[0]


class PackLoader:
    """Iterate one rank's packed batches through a DataLoader; ``state_dict()`` is the packs consumed.

    Counts only batches actually handed to the caller (not those prefetched by workers), so
    ``load_state_dict(state_dict())`` in a new process resumes exactly after the last batch used, at
    this or another world size at an optimizer step (:mod:`mmidx.train.state`), and refuses a state of
    another stream. It is a ``torch.distributed.checkpoint`` ``Stateful``: ``dcp.save({"data": loader})``
    stores the same small state on every rank. ``device``: when given, batches are moved there
    (``non_blocking`` from pinned memory). ``pack_costs``: the packs' costs to balance steps by
    (:class:`~mmidx.index.pack_costs.PackCosts`, or one cost per pack; see
    :class:`~mmidx.train.shares.GlobalBatchSampler`); None: contiguous shares. A world size that does not
    divide ``global_batch_size`` is refused here (``GlobalBatchError``), not at the first batch.
    """

    def __init__(self, dataset: PackDataset, *, global_batch_size: int, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int | None = None,
                 device: torch.device | str | None = None, pack_costs: PackCosts | np.ndarray | None = None):
        self.dataset = dataset
        self.pack_costs = pack_costs
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.device = device
        self.steps_consumed = 0
        self._shares = self.sampler()  # checks the shares now
        self._own = OwnStream()  # what a DCP load leaves of this loader's state_dict() is told apart

    def state_dict(self) -> dict[str, Any]:
        """``{"packs_consumed": n, "world_size": w, "global_batch_size": G, "stream": {...}, "batch_consumed":
        ...}``: the global packs consumed (every rank's micro-steps × world size), the same on every rank,
        with the shares and the stream they were consumed in (:mod:`mmidx.train.state`)."""
        state = state_after(self._shares, self.steps_consumed, self.dataset.identity)
        return self._own.mark(state)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Continue after the packs ``state`` consumed (:func:`~mmidx.train.state.steps_of_state`); a state of
        another stream is refused, or with ``strict=False`` continued on this one, warned."""
        self.steps_consumed = steps_of_state(state, self._shares, self.dataset.identity, strict=strict,
                                             own=self._own)

    def sampler(self) -> GlobalBatchSampler:
        return GlobalBatchSampler(len(self.dataset), global_batch_size=self.global_batch_size, rank=self.rank,
                                  world_size=self.world_size, start=self.steps_consumed, pack_costs=self.pack_costs)

    def __len__(self) -> int:
        return len(self.sampler())

    def __iter__(self) -> Iterator[PackedBatch]:
        extra = {"prefetch_factor": self.prefetch_factor} if self.num_workers and self.prefetch_factor else {}
        sampler = self.sampler()
        self.dataset.upcoming = WorkerSchedule(sampler, self.num_workers)
        self.dataset.schedule = NodeSchedule(sampler)
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=1, sampler=sampler, collate_fn=collate_pack,
            num_workers=self.num_workers, pin_memory=self.pin_memory, **extra)
        for batch in loader:
            if self.device is not None:
                batch = batch.to(self.device, non_blocking=self.pin_memory)
            self.steps_consumed += 1  # counted when handed out: a caller may stop right after using it
            yield batch
