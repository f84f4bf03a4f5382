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
  without it (saved by an older mmidx, or over packs that are no pack index) is read with a warning.
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


def _batch_consumed(shares: GlobalBatchSampler, batch: int, position: int) -> str:
    """A hash of the packs of global batch ``batch`` that the first ``position`` micro-steps of every rank ran."""
    return description_key({"packs": sorted(shares.deal(batch)[:position * shares.world_size].tolist())})


def _field(state: Mapping[str, Any], key: str, minimum: int, default: int | None = None) -> int:
    value = state.get(key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise LoaderStateError(f"the loader state's {key} must be an integer >= {minimum}, got {value!r}: pass "
                               "the state_dict() of an mmidx loader or sampler")
    return int(value)


def steps_of_state(state: Mapping[str, Any], shares: GlobalBatchSampler, identity: StreamIdentity | None = None, *,
                   strict: bool = True) -> int:
    """The micro-steps each rank of ``shares`` has taken, from a state saved at any world size (see the module):
    refused (``LoaderStateError``, one line) where this loader cannot continue exactly what the state consumed.
    ``identity``: this loader's stream (None: not checked); ``strict=False`` continues another stream anyway."""
    if not isinstance(state, Mapping):
        raise LoaderStateError(f"a loader state is a mapping (state_dict()), got {type(state).__name__}")
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
    steps = consumed // shares.world_size
    saved_deal = state.get("batch_consumed")
    if inside and saved_deal is not None and saved_deal != _batch_consumed(shares, consumed // batch_size,
                                                                           steps % shares.per_rank):
        raise LoaderStateError(f"the state was saved {inside} packs into global batch {consumed // batch_size:,}, "
                               "whose packs this loader deals to other micro-steps (balanced steps on or off, or "
                               "other pack_costs): resume with the pack_costs it was saved with, or from a "
                               "checkpoint taken at an optimizer step")
    if identity is not None and consumed:
        _check_stream(state.get("stream"), identity, consumed, takeover_pack(state), strict)
    return steps


def _check_stream(saved: Any, identity: StreamIdentity, consumed: int, end: int, strict: bool) -> None:
    """Refuse (or with ``strict=False`` warn about) a state whose ``consumed`` packs were another stream's."""
    if not saved:
        warnings.warn(f"the loader state records no stream (saved by an older mmidx, or over packs that are no pack "
                      f"index): resuming at pack {consumed:,} without checking that it continues this loader's stream",
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
