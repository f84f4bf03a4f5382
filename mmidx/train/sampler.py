"""A stateful sampler of one rank's pack numbers, for torch's and torchdata's DataLoader.

``StatefulDataLoader(PackDataset(...), sampler=PackSampler(...), batch_size=None, num_workers=N)``
yields one rank's packed batches in training order, and torchdata saves the sampler's state (the global packs
consumed, with the shares and the stream: :mod:`mmidx.train.state`) in its own ``state_dict``: its snapshots
pair each batch with the sampler's state when that batch's pack number was drawn, so a restored loader
continues with the next batch whatever the workers had prefetched. torchdata refuses a multi-process state in
a loader with another worker count; :meth:`PackSampler.resume_from` reads mmidx's state out of such a state,
so a new loader with any worker count (and world size, at an optimizer step) continues exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch

from mmidx.index.pack_costs import PackCosts
from mmidx.train.shares import GlobalBatchSampler
from mmidx.train.state import LoaderStateError, OwnStream, shared_steps, state_after, steps_of_state

# Where torchdata 0.11's StatefulDataLoader.state_dict() keeps the sampler's state: at its top level
# with no workers, in the snapshot of the main process's state with workers (_StatefulMultiProcessingDataLoaderIter).
_SAMPLER_STATE = "_index_sampler_state"
_SNAPSHOT, _MAIN_SNAPSHOT, _STEPS_SINCE_SNAPSHOT = "_snapshot", "_main_snapshot", "_steps_since_snapshot"


class PackSampler(torch.utils.data.Sampler[int]):
    """One rank's pack numbers in training order (its share of every global batch), resumable.

    The order is :class:`~mmidx.train.shares.GlobalBatchSampler`'s: ``global_batch_size`` packs make one
    global batch, rank ``r`` of ``world_size`` takes the ``r``-th contiguous share. Use it with
    ``batch_size=None`` (a pack is a micro-batch). The sampler is one pass over the pack stream: a new
    iteration continues where the last one's drawn packs ended (more data is a longer stream: ``num_samples``
    of the pack index), and ``state_dict()`` holds the global packs its iterations drew, the same on every
    rank, with the shares and the stream's identity (:mod:`mmidx.train.state`); it satisfies
    ``torch.distributed.checkpoint.stateful.Stateful``. A state of another stream is refused. With workers the
    loader draws ahead: save the loader's state (torchdata's snapshots account for that), not the sampler's.
    Datasets in object storage are fetched as each pack is built, without
    :class:`~mmidx.train.loader.PackLoader`'s look-ahead. ``pack_costs``
    (:class:`~mmidx.index.pack_costs.PackCosts`: each pack's cost after CFG dropout; or one cost per pack) turns on
    balanced steps: each global batch is dealt to (rank, micro-step) by cost, the same packs per global batch.
    """

    def __init__(self, dataset: Sized, *, global_batch_size: int = 1, rank: int = 0, world_size: int = 1,
                 pack_costs: PackCosts | np.ndarray | None = None):
        self.schedule = GlobalBatchSampler(len(dataset), global_batch_size=global_batch_size, rank=rank,
                                           world_size=world_size, pack_costs=pack_costs)
        self.identity = getattr(dataset, "identity", None)  # a PackDataset's stream (None: not checked)
        self.steps = 0  # micro-steps drawn by this rank
        self._own = OwnStream()  # what a DCP load leaves of this loader's state_dict() is told apart

    def __len__(self) -> int:
        """Micro-steps of this rank in the whole stream (the resumed part included, as torchdata's samplers)."""
        return len(self.schedule)

    def __iter__(self) -> Iterator[int]:
        while self.steps < len(self.schedule):
            pack = self.schedule.pack_of_step(self.steps)
            self.steps += 1  # counted when drawn: torchdata's snapshot of this state goes with this pack
            yield pack

    def state_dict(self) -> dict[str, Any]:
        state = state_after(self.schedule, self.steps, self.identity)
        return self._own.mark(state)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Continue after the packs ``state`` consumed; another world size only at an optimizer step, another
        stream only with ``strict=False`` (:func:`~mmidx.train.state.steps_of_state`)."""
        self.steps = steps_of_state(state, self.schedule, self.identity, strict=strict, own=self._own)

    def resume_from(self, loader_state: Mapping[str, Any], strict: bool = True) -> None:
        """Continue after the last batch a ``StatefulDataLoader`` over a ``PackSampler`` handed out.

        ``loader_state`` is that loader's ``state_dict()``, saved with any number of workers (0 too).
        Give a new loader this sampler and do not call its ``load_state_dict``: the new loader may
        have another worker count, which torchdata's own state cannot move to. The sampler's state in
        it is checked as ``load_state_dict(..., strict=strict)`` checks it, then the batches handed out
        after that snapshot are counted on.
        """
        if _SNAPSHOT in loader_state:
            sampler_state = loader_state[_SNAPSHOT][_MAIN_SNAPSHOT].get(_SAMPLER_STATE)
            steps_after = int(loader_state[_STEPS_SINCE_SNAPSHOT])  # batches handed out after that snapshot
        elif _SAMPLER_STATE in loader_state:
            sampler_state, steps_after = loader_state[_SAMPLER_STATE], 0
        else:
            raise LoaderStateError(f"not a StatefulDataLoader state (keys {sorted(loader_state)[:6]}): pass the "
                                   "loader's state_dict(), not the sampler's (use load_state_dict for that)")
        if not isinstance(sampler_state, Mapping) or "packs_consumed" not in sampler_state:
            raise LoaderStateError("the loader state holds no PackSampler state: it was saved by a loader with "
                                   "another sampler; start this one afresh")
        self.load_state_dict(sampler_state, strict=strict)
        if steps_after:  # micro-steps of the world that saved it, after the snapshot: counted on, shares checked
            saved = {key: sampler_state[key] for key in ("world_size", "global_batch_size") if key in sampler_state}
            world_size = saved.get("world_size", self.schedule.world_size)
            self.steps = shared_steps({**saved, "packs_consumed": sampler_state["packs_consumed"]
                                       + steps_after * world_size}, self.schedule)
