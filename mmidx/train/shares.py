"""Which pack each rank trains at each micro-step: ``GlobalBatchSampler``, a rank's share of every global batch,
and ``NodeSchedule``, the packs of a node's ranks (what the node's data cache reads when).

Order is a pure function of (config, seed, pack number): pack k is the same batch in any process, worker
or run. A *global batch* is ``global_batch_size`` consecutive packs; rank r of world w takes the r-th
contiguous share of each (or, with balanced steps, the packs dealt to it by cost), so the union of the
ranks' packs of a global batch is the single-rank global batch whatever w is.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from mmidx.errors import MMIDXError
from mmidx.index.cost import deal_by_cost
from mmidx.index.pack_costs import PackCosts


class GlobalBatchError(MMIDXError, ValueError):
    """A global batch the world size cannot share out evenly, a rank outside the world, or costs that do not
    cover the packs: refused where the loader or sampler is made, not at its first batch."""


class GlobalBatchSampler(torch.utils.data.Sampler[int]):
    """Pack numbers for one rank: its contiguous share of every global batch, from ``start`` on.

    ``global_batch_size`` packs make one global batch; each rank takes ``global_batch_size //
    world_size`` of them per global batch (its micro-batches, one pack each, as BAGEL trains).
    ``start`` counts micro-steps already taken by every rank (packs consumed // world_size).
    Incomplete trailing global batches are dropped.

    Balanced steps: with ``pack_costs`` (:class:`~mmidx.index.pack_costs.PackCosts` of the index, each pack's
    cost after CFG dropout, priced a global batch at a time as it is dealt; or any array of one cost per pack),
    each global batch is dealt by cost instead (:func:`mmidx.index.cost.deal_by_cost`): micro-step j of every rank
    runs packs of about the same cost, so no rank waits for a dearer one. A global batch holds the same packs
    either way, and the deal depends only on the batch's costs and the world size, the same on every rank and at
    every worker count, so a resume at an optimizer step is exact at any world size.
    """

    def __init__(self, num_packs: int, *, global_batch_size: int, rank: int = 0, world_size: int = 1,
                 start: int = 0, pack_costs: PackCosts | np.ndarray | None = None):
        for name, value in (("global_batch_size", global_batch_size), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise GlobalBatchError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= rank < world_size:
            raise GlobalBatchError(f"rank {rank} is not in a world of {world_size}")
        if global_batch_size % world_size:
            raise GlobalBatchError(f"global_batch_size {global_batch_size} must be a multiple of the world size "
                                   f"{world_size}, so every rank gets the same share")
        self.num_packs = num_packs
        self.global_batch_size = int(global_batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.start = start
        self.pack_costs = pack_costs if pack_costs is None or isinstance(pack_costs, PackCosts) else \
            np.asarray(pack_costs, dtype=np.float64)
        if self.pack_costs is not None and len(self.pack_costs) < num_packs:
            raise GlobalBatchError(f"pack_costs holds {len(self.pack_costs)} costs for {num_packs} packs: give one "
                                   "per pack of the index (PackCosts(index))")
        self._dealt: dict[int, np.ndarray] = {}  # the last global batches dealt: their packs in dealt order

    def deal(self, global_batch: int) -> np.ndarray:
        """Global batch ``global_batch``'s packs in (micro-step, rank) order: entry ``j * world_size + r`` is
        what rank r trains at its j-th micro-step of the batch."""
        first = global_batch * self.global_batch_size
        if self.pack_costs is None:
            return first + np.arange(self.global_batch_size).reshape(self.world_size, self.per_rank).T.ravel()
        dealt = self._dealt.get(global_batch)
        if dealt is None:  # kept with the one before: a worker's look-ahead crosses into the next batch and back
            dealt = first + deal_by_cost(self.pack_costs[first:first + self.global_batch_size], self.world_size)
            self._dealt = {**{b: d for b, d in self._dealt.items() if b == global_batch - 1}, global_batch: dealt}
        return dealt

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.world_size

    def __len__(self) -> int:
        return max(0, (self.num_packs // self.global_batch_size) * self.per_rank - self.start)

    def pack_of_step(self, step: int) -> int:
        """The pack this rank trains on at micro-step ``step``."""
        global_batch, position = divmod(step, self.per_rank)
        if self.pack_costs is not None:
            return int(self.deal(global_batch)[position * self.world_size + self.rank])
        return global_batch * self.global_batch_size + self.rank * self.per_rank + position

    def step_of_pack(self, pack: int) -> int | None:
        """The micro-step at which this rank trains on ``pack`` (None: another rank's pack)."""
        global_batch, offset = divmod(pack, self.global_batch_size)
        if self.pack_costs is not None:
            slot = int(np.flatnonzero(self.deal(global_batch) == pack)[0])
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
