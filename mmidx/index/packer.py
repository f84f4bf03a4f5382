"""Packing whole samples into token budgets: ``pack_samples`` (the kernel is ``csrc/_packing.pyx``).

Guarantee: every item is either in exactly one pack or in ``excluded`` (over the per-sample limit); no pack
holds more than ``max_num_tokens``; packs are a pure function of the inputs (no RNG); each pack starts with
one item of every mandatory group, in group order (except solo packs, exhausted groups, or a mandatory item
that does not fit beside the earlier ones); the deferral buffer never holds more than ``max_buffer_size + 1``
items. O(n log B) time. The rules are spelled out in ``pack_samples``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmidx import _packing
from mmidx.config import DEFAULT_COST_SLACK
from mmidx.index.cost import LLMGeometry


@dataclass(frozen=True)
class PackingResult:
    """Packs as stream positions: pack k is ``pack_items[pack_offsets[k]:pack_offsets[k + 1]]``."""

    pack_offsets: np.ndarray
    pack_items: np.ndarray
    excluded: np.ndarray
    pack_tokens: np.ndarray
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.pack_tokens)

    def pack(self, k: int) -> np.ndarray:
        """Stream positions of pack ``k``, in the order they were placed."""
        return self.pack_items[self.pack_offsets[k] : self.pack_offsets[k + 1]]


def pack_samples(
    token_counts: np.ndarray,
    groups: np.ndarray,
    *,
    mandatory: np.ndarray | list[bool],
    max_num_tokens: int = 36864,
    expected_num_tokens: int = 32768,
    max_num_tokens_per_sample: int = 16384,
    prefer_buffer_before: int = 16384,
    max_buffer_size: int = 50,
    policy: str = "bagel",
    window: int = 128,
    cost_slack: float | None = DEFAULT_COST_SLACK,
    geometry: LLMGeometry | None = None,
) -> PackingResult:
    """Pack a stream of whole samples into packs of about ``expected_num_tokens`` (BAGEL budgets
    by default), deterministically and without losing any sample.

    ``token_counts[i]`` is the exact packed size of stream item i, ``groups[i]`` its group and
    ``mandatory[g]`` whether every pack should start with an item of group g. The rules:

    - an item over ``max_num_tokens_per_sample`` is excluded (listed in ``excluded``, counted);
    - a pack starts with one item of each mandatory group, in group order: the earliest unplaced
      item of the group in stream order (wherever it is); one that does not fit waits for the next
      pack. Then the deferral buffer fills it, largest fitting item first (the earliest deferred
      among equal counts), while it holds fewer than ``prefer_buffer_before`` tokens;
    - then stream items in order: one that fits (total <= ``max_num_tokens``) goes in, one that
      does not is deferred to the buffer. The pack closes once it holds ``expected_num_tokens`` or
      the buffer holds more than ``max_buffer_size`` items;
    - if, right after a pack was started and refilled, the buffer still holds more than
      ``max_buffer_size`` items, its largest item is emitted as a pack of its own (a solo pack,
      ahead of the open one), so the buffer stays bounded;
    - at the end of the stream the open pack, then new packs (mandatory items first), are filled
      from the buffer, largest fitting first, up to ``expected_num_tokens``, until it is empty; the
      last pack may be partial (``stats['partial_last_pack']``).

    ``stats['max_deferral']`` is the most packs emitted while one item waited in the buffer.

    ``policy="bagel"`` (the default) is the rules above, BAGEL's packs exactly. ``policy="tight"`` fills
    packs toward ``max_num_tokens`` from a window of the stream (``window`` items; the BAGEL budgets
    ``expected_num_tokens``, ``prefer_buffer_before`` and ``max_buffer_size`` do not apply): every
    item enters the window; while it holds ``window`` items a pack is made of one item of each
    mandatory group (as above), then the window's earliest items in stream order while the pack
    holds under half of ``max_num_tokens`` (so packs follow the blend), then, again and again, the
    largest window item that fits the room left (best fit), until none fits. The window's earliest
    item goes into every pack, so an item is packed by the ``window``-th pack closed from its arrival,
    and at rank r of the packs' concatenation an item of stream position p has p - r <= ``window`` - 2
    (without mandatory groups or exclusions, which move items by their count). Behind its place it
    can wait longer than ``window`` items while packs take the small items best fit finds (on the
    benchmark mixes, 10^5 samples, at most 35 places). At the end the window is packed the same way.

    With ``cost_slack`` (tight only; ``None`` turns it off) the tight packer caps each pack's modelled
    compute as well as its tokens, so packs that run side by side in a data-parallel step cost alike: a
    sample of n tokens costs ``linear·n + attention·n²`` (``geometry``'s cost model, Qwen2-7B by default,
    see ``mmidx.index.cost``), and an item fits only if the pack's cost stays within ``1 + cost_slack``
    times that of a full pack (``max_num_tokens``) of the stream's recent average sample (its Σn²/Σn over
    about the last 4,096 items to enter the window). Packs full of long samples so close a little short
    of the cap in tokens; ``stats['cost_capped_packs']`` counts those the cost cap closed while an item
    still fitted the tokens left. The window's earliest item always goes in (the window's bounds hold).
    """
    _check_budgets(max_num_tokens, expected_num_tokens, max_num_tokens_per_sample, prefer_buffer_before,
                   max_buffer_size)
    tight = _check_policy(policy, window, cost_slack)
    counts = np.asarray(token_counts)
    group_ids = np.asarray(groups)
    if counts.size and not np.issubdtype(counts.dtype, np.integer):
        raise TypeError(f"token_counts must be integers (exact packed sizes), got {counts.dtype}")
    if group_ids.size and not np.issubdtype(group_ids.dtype, np.integer):
        raise TypeError(f"groups must hold integer group ids, got {group_ids.dtype}")
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    mandatory = np.ascontiguousarray(mandatory, dtype=bool)
    if counts.ndim != 1 or group_ids.shape != counts.shape:
        raise ValueError("token_counts and groups must be 1-D and of equal length, one per stream item")
    if group_ids.size and (int(group_ids.min()) < 0 or int(group_ids.max()) >= len(mandatory)):
        raise ValueError(f"group ids must be in [0, {len(mandatory)}), one mandatory flag per group")
    group_ids = np.ascontiguousarray(group_ids, dtype=np.int32)

    packer = _packer(mandatory, max_num_tokens, expected_num_tokens, max_num_tokens_per_sample,
                     prefer_buffer_before, max_buffer_size, len(counts), tight=tight, window=window,
                     cost_slack=cost_slack, geometry=geometry)
    # The whole stream is at hand: every mandatory item is lookahead from the start.
    positions = np.arange(len(counts), dtype=np.int64)
    _check_kernel(packer.lookahead(counts, group_ids, positions, mandatory.view(np.uint8)), "token_counts", counts)
    for group in np.flatnonzero(mandatory):
        packer.end_lookahead(int(group))
    _, needed = packer.feed(counts, group_ids, positions, 0, 0)
    _check_kernel(-2 - needed if needed < -1 else -1, "token_counts", counts)
    packer.finish()
    pack_items, pack_ends, pack_tokens, excluded = packer.drain()
    return PackingResult(pack_offsets=np.concatenate(([0], pack_ends)).astype(np.int64), pack_items=pack_items,
                         excluded=excluded, pack_tokens=pack_tokens,
                         stats=packing_stats(packer, max_num_tokens, expected_num_tokens))


def _check_budgets(max_num_tokens: int, expected_num_tokens: int, max_num_tokens_per_sample: int,
                   prefer_buffer_before: int, max_buffer_size: int) -> None:
    for name, value in (
        ("max_num_tokens", max_num_tokens),
        ("expected_num_tokens", expected_num_tokens),
        ("max_num_tokens_per_sample", max_num_tokens_per_sample),
    ):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if expected_num_tokens > max_num_tokens:
        raise ValueError(
            f"expected_num_tokens ({expected_num_tokens}) exceeds max_num_tokens ({max_num_tokens}); "
            "lower it or raise max_num_tokens"
        )
    if max_num_tokens_per_sample > max_num_tokens:
        raise ValueError(
            f"max_num_tokens_per_sample ({max_num_tokens_per_sample}) exceeds max_num_tokens "
            f"({max_num_tokens}): such a sample could never be packed; lower it"
        )
    if prefer_buffer_before < 0 or max_buffer_size < 0:
        raise ValueError("prefer_buffer_before and max_buffer_size must be non-negative")


POLICIES = ("bagel", "tight")


# The cost cap's integer arithmetic holds for packs of up to 2^24 tokens (Σn² over 4,096 items stays in int64).
MAX_COST_CAPPED_TOKENS = 1 << 24


def _check_policy(policy: str, window: int, cost_slack: float | None = None) -> bool:
    """Validate a packing policy, its window and cost slack; True for ``tight``."""
    if policy not in POLICIES:
        raise ValueError(f"packing policy must be one of {POLICIES}, got {policy!r}")
    if window < 1:
        raise ValueError(f"the tight policy's window must be at least 1 item, got {window}")
    if cost_slack is not None and not 0 <= cost_slack <= 1:
        raise ValueError(f"the tight policy's cost_slack must be a fraction in [0, 1] (e.g. 0.065 for 6.5%) or "
                         f"None to cap tokens only, got {cost_slack}")
    return policy == "tight"


def _packer(mandatory: np.ndarray, max_num_tokens: int, expected_num_tokens: int, max_num_tokens_per_sample: int,
            prefer_buffer_before: int, max_buffer_size: int, stream_length: int, *, tight: bool = False,
            window: int = 128, cost_slack: float | None = DEFAULT_COST_SLACK,
            geometry: LLMGeometry | None = None) -> _packing.Packer:
    """The kernel's packer for a stream of ``stream_length`` items; with ``tight`` and a ``cost_slack``, the cost
    cap in the geometry's integer weights (the slack in basis points). Every budget is named: the kernel takes
    them by position, and one left out would shift the rest into the wrong places."""
    linear, attention = (geometry or LLMGeometry()).cost_weights
    capped = tight and cost_slack is not None
    if capped and max_num_tokens > MAX_COST_CAPPED_TOKENS:
        raise ValueError(f"the cost cap handles max_num_tokens up to {MAX_COST_CAPPED_TOKENS:,}, got "
                         f"{max_num_tokens:,}; set cost_slack to None (packing: {{cost_slack: null}}) for larger packs")
    return _packing.Packer(np.ascontiguousarray(mandatory, dtype=bool).view(np.uint8), max_num_tokens,
                           expected_num_tokens, max_num_tokens_per_sample, prefer_buffer_before, max_buffer_size,
                           stream_length, tight, window, linear, attention, round(cost_slack * 10000) if capped else -1)


def _check_kernel(bad: int, name: str, counts: np.ndarray) -> None:
    if bad >= 0:
        raise ValueError(f"{name}[{bad}] = {counts[bad]} is negative")


def packing_stats(packer: _packing.Packer, max_num_tokens: int, expected_num_tokens: int) -> dict[str, Any]:
    """The packer's counters: packs, items, exclusions, deferrals, solo packs and fill."""
    num_packs = packer.num_packs
    mean_tokens = packer.tokens / num_packs if num_packs else 0.0
    cost = {"cost_capped_packs": packer.cost_capped_packs} if packer.cost_aware else {}
    return {
        "num_packs": num_packs,
        "num_items": packer.num_items,
        "excluded": packer.num_excluded,
        "deferred": packer.deferred,
        "max_deferral": packer.max_deferral,
        "solo_packs": packer.solo_packs,
        "partial_last_pack": bool(num_packs and packer.last_pack_tokens < expected_num_tokens),
        "fill_vs_max": mean_tokens / max_num_tokens,
        "fill_vs_expected": mean_tokens / expected_num_tokens,
        **cost,
    }
