"""torch integration: a map-style dataset of packs, a rank-aware sampler, and a resumable loader.

Order is a pure function of (config, seed, pack number): pack k is the same batch in any process,
worker or run. A *global batch* is ``global_batch_size`` consecutive packs; rank r of world w takes
the r-th contiguous share of each, so the union of the ranks' packs of a global batch is the
single-rank global batch whatever w is. Resume state is one integer: the packs consumed so far.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mmidx.errors import MMIDXError
from mmidx.index.cost import deal_by_cost
from mmidx.index.pack_index import PackItem
from mmidx.pack.batch import PackedBatch
from mmidx.pack.builder import PackBuilder
from mmidx.read.prefetch import PackPrefetcher, WorkerSchedule


class LoaderStateError(MMIDXError, ValueError):
    """A saved loader state that cannot resume here (another world size mid-batch, another loader's state)."""


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

    def __getitem__(self, index: int) -> PackedBatch:
        items: Sequence[PackItem] = self.packs.items(index)
        if not any(dataset.remote_files for group in self.builder.datasets for dataset in group):
            return self.builder.build(index, items)
        if self._prefetcher is None:
            self._prefetcher = PackPrefetcher(self.packs, self.builder.datasets, schedule=self.schedule)
        self._prefetcher.before(index, self.upcoming(index) if self.upcoming else [])
        try:
            return self.builder.build(index, items)
        finally:
            self._prefetcher.after(index)


class GlobalBatchSampler(torch.utils.data.Sampler[int]):
    """Pack numbers for one rank: its contiguous share of every global batch, from ``start`` on.

    ``global_batch_size`` packs make one global batch; each rank takes ``global_batch_size //
    world_size`` of them per global batch (its micro-batches, one pack each, as BAGEL trains).
    ``start`` counts micro-steps already taken by every rank (packs consumed // world_size).
    Incomplete trailing global batches are dropped.

    Balanced steps: with ``pack_costs`` (one cost per pack, e.g. :func:`mmidx.index.cost.pack_costs`
    of the index's packs), each global batch is dealt by cost instead (:func:`mmidx.index.cost.deal_by_cost`):
    micro-step j of every rank runs packs of about the same cost, so no rank waits for a dearer one.
    A global batch holds the same packs either way, and the deal depends only on the batch and the
    world size, so a resume at an optimizer step is exact at any world size.
    """

    def __init__(self, num_packs: int, *, global_batch_size: int, rank: int = 0, world_size: int = 1,
                 start: int = 0, pack_costs: np.ndarray | None = None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if global_batch_size % world_size:
            raise ValueError(f"global_batch_size {global_batch_size} must be a multiple of the world size "
                             f"{world_size}, so every rank gets the same share")
        self.num_packs = num_packs
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.start = start
        self.pack_costs = None if pack_costs is None else np.asarray(pack_costs, dtype=np.float64)
        if self.pack_costs is not None and len(self.pack_costs) < num_packs:
            raise ValueError(f"pack_costs holds {len(self.pack_costs)} costs for {num_packs} packs")
        self._dealt: tuple[int, np.ndarray] | None = None  # (global batch, its packs in dealt order)

    def _deal(self, global_batch: int) -> np.ndarray:
        """Global batch ``global_batch``'s packs in (micro-step, rank) order."""
        if self._dealt is None or self._dealt[0] != global_batch:
            first = global_batch * self.global_batch_size
            order = deal_by_cost(self.pack_costs[first:first + self.global_batch_size], self.world_size)
            self._dealt = (global_batch, first + order)
        return self._dealt[1]

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.world_size

    def __len__(self) -> int:
        return max(0, (self.num_packs // self.global_batch_size) * self.per_rank - self.start)

    def pack_of_step(self, step: int) -> int:
        """The pack this rank trains on at micro-step ``step``."""
        global_batch, position = divmod(step, self.per_rank)
        if self.pack_costs is not None:
            return int(self._deal(global_batch)[position * self.world_size + self.rank])
        return global_batch * self.global_batch_size + self.rank * self.per_rank + position

    def step_of_pack(self, pack: int) -> int | None:
        """The micro-step at which this rank trains on ``pack`` (None: another rank's pack)."""
        global_batch, offset = divmod(pack, self.global_batch_size)
        if self.pack_costs is not None:
            slot = int(np.flatnonzero(self._deal(global_batch) == pack)[0])
            position, rank = divmod(slot, self.world_size)
            return global_batch * self.per_rank + position if rank == self.rank else None
        position = offset - self.rank * self.per_rank
        return global_batch * self.per_rank + position if 0 <= position < self.per_rank else None

    def __iter__(self) -> Iterator[int]:
        for step in range(self.start, self.start + len(self)):
            yield self.pack_of_step(step)


class NodeSchedule:
    """The packs the ranks of one node train on at each micro-step: when the node's data cache reads what.

    Every process of the node (each rank's loader workers) computes the same schedule from the sampler's
    arguments, so their caches evict by one order without talking. ``ranks``: the node's ranks, by default
    those torchrun puts there (``LOCAL_WORLD_SIZE`` consecutive ranks around ``rank``, :func:`node_ranks`).
    """

    def __init__(self, sampler: GlobalBatchSampler, ranks: Sequence[int] | None = None):
        ranks = node_ranks(sampler.rank, sampler.world_size) if ranks is None else ranks
        self.samplers = [GlobalBatchSampler(sampler.num_packs, global_batch_size=sampler.global_batch_size, rank=rank,
                                            world_size=sampler.world_size, start=sampler.start,
                                            pack_costs=sampler.pack_costs) for rank in ranks]
        self.steps = range(sampler.start, sampler.start + len(sampler))

    def __call__(self, step: int) -> list[int]:
        return [sampler.pack_of_step(step) for sampler in self.samplers]

    def step_of(self, pack: int) -> int | None:
        """The step at which a rank of the node trains on ``pack`` (None: no rank of this node does)."""
        return next((step for sampler in self.samplers if (step := sampler.step_of_pack(pack)) is not None), None)


def node_ranks(rank: int, world_size: int) -> range:
    """The ranks on this rank's node: ``LOCAL_WORLD_SIZE`` consecutive ranks from ``rank - LOCAL_RANK`` (what
    torchrun sets), or ``rank`` alone without them."""
    local, size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if not 0 <= local < size or local > rank:
        return range(rank, rank + 1)
    return range(rank - local, min(rank - local + size, world_size))


def collate_pack(batch: list[PackedBatch]) -> PackedBatch:
    """DataLoader collate for one pack per micro-batch (BAGEL's batch_size=1)."""
    if len(batch) != 1:
        raise ValueError(f"a micro-batch is one pack; use DataLoader(batch_size=1), got {len(batch)}")
    return batch[0]


def steps_of_state(state: Mapping[str, int], *, global_batch_size: int, world_size: int) -> int:
    """The micro-steps each rank of ``world_size`` has taken, from a loader state saved at any world size.

    ``state`` is ``{"packs_consumed": n}``, with the ``"world_size"`` it was saved at when known (older
    states lack it). At a global-batch boundary (an optimizer step) the packs consumed are the first n
    of the stream, so any world size resumes there. Inside a global batch each rank has consumed the
    first few packs of its own share, which another world size shares out differently: such a state
    resumes only at the world size that saved it.
    """
    consumed = int(state["packs_consumed"])
    saved_world_size = int(state.get("world_size", world_size))
    if saved_world_size != world_size and consumed % global_batch_size:
        raise LoaderStateError(f"the state was saved {consumed % global_batch_size} packs into a global batch of "
                         f"{global_batch_size} at world size {saved_world_size}: resume it at world size "
                         f"{saved_world_size}, or from a checkpoint taken at an optimizer step")
    if consumed % world_size:
        raise LoaderStateError(f"{consumed} packs consumed is not a whole number of micro-steps for world size "
                         f"{world_size}")
    return consumed // world_size


class PackLoader:
    """Iterate one rank's packed batches through a DataLoader; ``state_dict()`` is the packs consumed.

    Counts only batches actually handed to the caller (not those prefetched by workers), so
    ``load_state_dict(state_dict())`` in a new process resumes exactly after the last batch used, at
    this or another world size (:func:`steps_of_state`). It is a ``torch.distributed.checkpoint``
    ``Stateful``: ``dcp.save({"data": loader})`` stores one global integer, the same on every rank.
    ``device``: when given, batches are moved there (``non_blocking`` from pinned memory).
    ``pack_costs``: one cost per pack to balance steps by (see :class:`GlobalBatchSampler`); None: contiguous shares.
    """

    def __init__(self, dataset: PackDataset, *, global_batch_size: int, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int | None = None,
                 device: torch.device | str | None = None, pack_costs: np.ndarray | None = None):
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

    def state_dict(self) -> dict[str, int]:
        """``{"packs_consumed": n, "world_size": w}``: global packs consumed (every rank's micro-steps × world
        size), the same on every rank, and the world size it was saved at (see :func:`steps_of_state`)."""
        return {"packs_consumed": self.steps_consumed * self.world_size, "world_size": self.world_size}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.steps_consumed = steps_of_state(state, global_batch_size=self.global_batch_size,
                                             world_size=self.world_size)

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
