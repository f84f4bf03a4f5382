"""The resume state of mmidx's loaders and samplers: how far a run is in its stream, and which stream it is.

``{"packs_consumed": n, "world_size": w, "global_batch_size": G, "stream": {...}, "batch_consumed": None}``:
plain integers and short strings, the same on every rank (DCP keeps one copy; ``torch.load(weights_only=True)``
reads it), with the same keys at every step (DCP loads a state into the keys a new loader's state has).

- ``packs_consumed``: the global packs consumed, every rank's micro-steps × the world size.
- ``world_size`` and ``global_batch_size``: the shares it was saved with. At a global-batch boundary (an
  optimizer step) the packs consumed are the first n of the stream, so any world size, and any global batch
  size that divides n, resumes there. Inside a global batch each rank has used the first packs of its own
  share, which only the same world size, global batch size and deal share out alike: ``batch_consumed``, a
  hash of the batch's packs consumed (None at a boundary), checks the deal (balanced steps or not, the costs).
- ``stream``: the stream's identity (:mod:`mmidx.index.identity`). A loader over another stream refuses the
  state in one line naming what differs (the seed, the config, the datasets, the mixture...), unless it is
  loaded with ``strict=False``, which continues this loader's stream at pack n with a warning. A state
  without it (saved by an older mmidx, or over packs that are no pack index) is read with a warning; one
  that also lacks ``batch_consumed`` and ends inside a global batch is refused (which rank ran which of the
  batch's packs cannot be checked) unless loaded with ``strict=False``.

``torch.distributed.checkpoint`` loads a checkpoint in place into the dict the loader's ``state_dict()``
returned, and with ``allow_partial_load=True`` leaves the keys the checkpoint lacks as they were: an older
mmidx's checkpoint then arrives holding this loader's own stream and deal, which would pass every check.
:class:`OwnStream` recognises them, so such a load is read as the older state it is, warned and checked alike.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from typing import Any

from mmidx.errors import MMIDXError
from mmidx.index.cache import description_key
from mmidx.index.history import takeover_pack
from mmidx.index.identity import StreamIdentity
from mmidx.train.shares import GlobalBatchSampler


class LoaderStateError(MMIDXError, ValueError):
    """A saved loader state that cannot resume here: another world size or deal inside a global batch, another
    stream, another loader's state, or a malformed one."""


def state_after(shares: GlobalBatchSampler, steps: int, identity: StreamIdentity | None) -> dict[str, Any]:
    """The state after ``steps`` micro-steps of every rank of ``shares`` over the stream ``identity`` names."""
    batch, position = divmod(steps, shares.per_rank)
    end = (batch + (position > 0)) * shares.global_batch_size  # the packs dealt so far: whole global batches
    return {"packs_consumed": steps * shares.world_size, "world_size": shares.world_size,
            "global_batch_size": shares.global_batch_size,
            "stream": {} if identity is None else identity.parts(end),
            "batch_consumed": _batch_consumed(shares, batch, position) if position else None}


class OwnStream:
    """A loader's own copies of its stream's hashes, which the states it hands out hold, to tell a state it
    made from one it was given.

    ``dcp.load`` calls ``state_dict()``, loads the checkpoint into that very dict (torchdata's
    ``StatefulDataLoader`` into the sampler's dict of a snapshot), each value it loads a new, unpickled, object,
    then calls ``load_state_dict`` with it. With ``allow_partial_load=True`` the keys the checkpoint lacks (an
    older mmidx's: the stream and the deal) keep this loader's values, which would pass every check. A state
    that holds these copies was made by this loader, not loaded: :meth:`loaded` reads it without the stream
    and the deal, as the older state it is. (A ``world_size`` or ``global_batch_size`` so left is this
    loader's, which is what a state without them is read with.)
    """

    def __init__(self) -> None:
        self._copies: dict[str, str] = {}  # a stream hash -> this loader's copy of it (another object)

    def mark(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (this loader's, from :func:`state_after`) with its stream's hashes replaced by the copies."""
        for part, value in state["stream"].items():
            if isinstance(value, str):
                state["stream"][part] = self._copies.setdefault(value, value.encode().decode())
        return state

    def loaded(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state`` without the stream and the deal, if its stream is this loader's copies (see the class)."""
        stream = state.get("stream")
        if not isinstance(stream, Mapping) or not any(stream.get(part) is copy for part, copy in
                                                      ((p, self._copies.get(v)) for p, v in stream.items()
                                                       if isinstance(v, str))):
            return state
        return {key: value for key, value in state.items() if key not in ("stream", "batch_consumed")}


def _batch_consumed(shares: GlobalBatchSampler, batch: int, position: int) -> str:
    """A hash of the packs of global batch ``batch`` that the first ``position`` micro-steps of every rank ran."""
    return description_key({"packs": sorted(shares.deal(batch)[:position * shares.world_size].tolist())})


def _field(state: Mapping[str, Any], key: str, minimum: int, default: int | None = None) -> int:
    value = state.get(key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise LoaderStateError(f"the loader state's {key} must be an integer >= {minimum}, got {value!r}: pass "
                               "the state_dict() of an mmidx loader or sampler")
    return int(value)


def shared_steps(state: Mapping[str, Any], shares: GlobalBatchSampler) -> int:
    """The micro-steps each rank of ``shares`` has taken after the state's ``packs_consumed``, checking only the
    shares (its world size and global batch size against these; see the module), not its deal or stream."""
    consumed = _field(state, "packs_consumed", 0)
    world_size = _field(state, "world_size", 1, shares.world_size)
    batch_size = _field(state, "global_batch_size", 1, shares.global_batch_size)  # older states: this loader's
    inside = consumed % batch_size
    if inside and (world_size, batch_size) != (shares.world_size, shares.global_batch_size):
        raise LoaderStateError(f"the state was saved {inside} packs into a global batch of {batch_size} at world "
                               f"size {world_size}: resume it at world size {world_size} with global_batch_size "
                               f"{batch_size}, or from a checkpoint taken at an optimizer step")
    if not inside and consumed % shares.global_batch_size:
        raise LoaderStateError(f"the state's {consumed:,} packs consumed end inside a global batch of "
                               f"{shares.global_batch_size}: resume with a global_batch_size that divides {consumed:,} "
                               f"(the state's was {batch_size}), or from a checkpoint where it does")
    if consumed % shares.world_size:
        raise LoaderStateError(f"{consumed} packs consumed is not a whole number of micro-steps for world size "
                               f"{shares.world_size}")
    return consumed // shares.world_size


def steps_of_state(state: Mapping[str, Any], shares: GlobalBatchSampler, identity: StreamIdentity | None = None, *,
                   strict: bool = True, own: OwnStream | None = None) -> int:
    """The micro-steps each rank of ``shares`` has taken, from a state saved at any world size (see the module):
    refused (``LoaderStateError``, one line) where this loader cannot continue exactly what the state consumed.
    ``identity``: this loader's stream (None: not checked); ``strict=False`` continues another stream anyway.
    ``own``: the stream copies of this loader's states (:class:`OwnStream`: what a partial DCP load left)."""
    if not isinstance(state, Mapping):
        raise LoaderStateError(f"a loader state is a mapping (state_dict()), got {type(state).__name__}")
    if own is not None:
        state = own.loaded(state)
    steps = shared_steps(state, shares)  # inside a global batch, the state's shares are these
    batch, inside = divmod(steps * shares.world_size, shares.global_batch_size)
    saved_deal = state.get("batch_consumed")
    if inside and saved_deal is not None and saved_deal != _batch_consumed(shares, batch, steps % shares.per_rank):
        raise LoaderStateError(f"the state was saved {inside} packs into global batch {batch:,}, "
                               "whose packs this loader deals to other micro-steps (balanced steps on or off, or "
                               "other pack_costs): resume with the pack_costs it was saved with, or from a "
                               "checkpoint taken at an optimizer step")
    if inside and saved_deal is None:
        _unchecked_deal(inside, shares.global_batch_size, strict)
    if identity is not None and steps:
        _check_stream(state.get("stream"), identity, steps * shares.world_size, takeover_pack(state), strict)
    return steps


def _unchecked_deal(inside: int, batch_size: int, strict: bool) -> None:
    """Refuse (or with ``strict=False`` warn about) a state inside a global batch that records no deal."""
    message = (f"the state was saved {inside} packs into a global batch of {batch_size} but records no deal "
               "(saved by an older mmidx, or loaded partially from its checkpoint): which rank ran which of the "
               "batch's packs cannot be checked")
    if strict:
        raise LoaderStateError(f"{message}; resume from a checkpoint taken at an optimizer step, or load it with "
                               "strict=False to continue anyway")
    warnings.warn(f"{message}; continuing as strict=False asks", stacklevel=4)


def _check_stream(saved: Any, identity: StreamIdentity, consumed: int, end: int, strict: bool) -> None:
    """Refuse (or with ``strict=False`` warn about) a state whose ``consumed`` packs were another stream's."""
    if not saved:
        warnings.warn(f"the loader state records no stream (saved by an older mmidx, loaded partially from its "
                      f"checkpoint, or over packs that are no pack index): resuming at pack {consumed:,} without "
                      "checking that it continues this loader's stream",
                      stacklevel=4)
        return
    if not isinstance(saved, Mapping):
        raise LoaderStateError(f"the loader state's stream must be a mapping of its parts, got {saved!r}")
    differences = identity.differences(saved, end)
    if not differences:
        return
    if all(part.startswith("the mixture") for part in differences):
        fix = ("record a change of weights or schedule in the run's mixture history (trainer_loader(history=...) "
               "or mmidx.index.history.resumed_history), whose pack index continues the stream")
    else:
        fix = "resume with the config, seed and datasets it was saved with"
    message = (f"the state consumed {consumed:,} packs of another stream than this loader's "
               f"({'; '.join(differences)} differ{'s' if len(differences) == 1 else ''})")
    if strict:
        raise LoaderStateError(f"{message}: {fix}, or load it with strict=False to continue this stream at pack "
                               f"{consumed:,} anyway")
    warnings.warn(f"{message}; continuing this stream at pack {consumed:,} as strict=False asks", stacklevel=4)
