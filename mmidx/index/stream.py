"""The multimodal stream: which sample, and which of its views, comes next — ``multimodal_stream``,
``stream_views``, ``ViewTable``.

Guarantee: the group order is the greedy blend of :mod:`mmidx.index.blend`; the j-th item taken from group g
is sample ``P(g, e)[j % n_g]`` of epoch ``e = j // n_g``, where ``P(g, e)`` is a keyed pseudo-random
permutation of the group's n_g samples (a cycle-walked Feistel network keyed by ``SeedSequence([seed, g])``
and e; ``csrc/_stream.pyx``). Each epoch visits every sample once, a partial last epoch is a pseudo-random
subset shuffled apart, a longer stream extends a shorter one, and no array of size n_g is ever built: O(1)
memory per group, whatever its size (a ``numpy`` permutation per epoch would need n_g int64s for every epoch
touched). Token counts follow DESIGN's views: epoch e of a sample with K views uses view ``e mod K``, so
every count is exact before any data is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmidx import _stream
from mmidx.index.blend import blending_indices


def multimodal_stream(
    group_sizes: np.ndarray | list[int],
    weights: np.ndarray | list[float],
    num_samples: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group_ids int32, sample_ids int64, epochs int64) of a ``num_samples``-item blended stream.

    Groups are interleaved by ``blending_indices(weights, num_samples)``; each group walks through
    its own per-epoch permutations, keyed by ``SeedSequence([seed, group])`` and the epoch (see
    the module doc for the guarantees). ``seed`` is a non-negative integer.
    """
    group_sizes = np.ascontiguousarray(group_sizes, dtype=np.int64)
    if group_sizes.ndim != 1 or group_sizes.shape != np.shape(weights):
        raise ValueError("group_sizes and weights must be 1-D and of equal length, one per group")
    if np.any(group_sizes <= 0):
        raise ValueError("every group needs at least one sample; leave out empty groups")
    group_ids, taken = blending_indices(weights, num_samples)
    group_keys = _group_keys(seed, len(group_sizes))
    sample_ids = np.empty(num_samples, dtype=np.int64)
    epochs = np.empty(num_samples, dtype=np.int64)
    _stream.stream_samples(group_ids, taken, group_sizes, group_keys, sample_ids, epochs)
    return group_ids.astype(np.int32), sample_ids, epochs


def stream_views(
    group_ids: np.ndarray,
    sample_ids: np.ndarray,
    epochs: np.ndarray,
    view_offsets: list[np.ndarray],
    view_token_counts: list[np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """(views int32, token counts int64) of every stream item: view ``epoch mod K`` of its sample's K views.

    Per group g, the views of sample s are ``view_token_counts[g][view_offsets[g][s] :
    view_offsets[g][s + 1]]`` (ragged, ``view_offsets[g]`` has samples + 1 entries from 0).
    """
    table = ViewTable.of(view_offsets, view_token_counts)
    group_ids = np.ascontiguousarray(group_ids, dtype=np.int32)
    sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
    epochs = np.ascontiguousarray(epochs, dtype=np.int64)
    if group_ids.size and (int(group_ids.min()) < 0 or int(group_ids.max()) >= table.num_groups):
        raise ValueError(f"group ids must be in [0, {table.num_groups}), one view table per group")
    if np.any(sample_ids < 0) or np.any(sample_ids >= np.diff(table.group_base)[group_ids]):
        raise ValueError("a sample id is outside its group's view_offsets")
    if np.any(epochs < 0):
        raise ValueError("epochs must be non-negative")
    views = np.empty(len(group_ids), dtype=np.int32)
    counts = np.empty(len(group_ids), dtype=np.int64)
    _stream.item_views(group_ids, sample_ids, epochs, table.group_base, table.kernel_offsets, table.view_tokens, 1,
                       views, counts, np.empty(0, np.int64))
    return views, counts


@dataclass(frozen=True)
class ViewTable:
    """Every group's per-sample view sizes, laid end to end: samples are numbered across groups
    (group g's sample s is ``group_base[g] + s``), and the views of sample i are
    ``view_tokens[offsets[i]:offsets[i + 1]]``; with ``offsets`` None every sample has one view, view i of
    ``view_tokens`` (the pack index's table then costs 4 bytes a sample: int32 counts and no offsets).
    ``max_views``: the most views a sample has."""

    group_base: np.ndarray
    view_tokens: np.ndarray
    offsets: np.ndarray | None = None
    max_views: int = 1

    @property
    def num_groups(self) -> int:
        return len(self.group_base) - 1

    @property
    def view_offsets(self) -> np.ndarray:
        """Where each sample's views start in ``view_tokens``, then their total (made, 8 bytes a sample, when the
        table keeps none: to read many items' sizes, :meth:`tokens_of` needs no offsets)."""
        if self.offsets is not None:
            return self.offsets
        return np.arange(len(self.view_tokens) + 1, dtype=np.int64)

    @property
    def kernel_offsets(self) -> np.ndarray:
        """The offsets as the stream kernel takes them: empty for one view per sample."""
        return np.zeros(0, np.int64) if self.offsets is None else self.offsets

    def tokens_of(self, samples: np.ndarray, views: np.ndarray | int = 0) -> np.ndarray:
        """The token counts (int64) of view ``views`` of each of ``samples`` (numbered across groups)."""
        samples = np.asarray(samples, dtype=np.int64)
        places = samples if self.offsets is None else self.offsets[samples] + views
        return self.view_tokens[places].astype(np.int64)

    @classmethod
    def of(cls, view_offsets: list[np.ndarray], view_token_counts: list[np.ndarray]) -> ViewTable:
        """From per-group (view_offsets, view_token_counts), checking that every sample has a view."""
        if len(view_offsets) != len(view_token_counts) or not view_offsets:
            raise ValueError("view_offsets and view_token_counts must have one entry per group")
        offsets, tokens, base, count_base, max_views = [np.zeros(1, np.int64)], [], [0], 0, 1
        for group, (group_offsets, group_counts) in enumerate(zip(view_offsets, view_token_counts, strict=True)):
            group_offsets = np.asarray(group_offsets, dtype=np.int64)
            if (group_offsets.ndim != 1 or group_offsets.size < 2 or group_offsets[0] != 0
                    or group_offsets[-1] != len(group_counts)):
                raise ValueError(f"view_offsets[{group}] must start at 0 and end at len(view_token_counts[{group}]), "
                                 "with at least one sample")
            group_views = np.diff(group_offsets)
            if np.any(group_views <= 0):
                empty = int(np.argmax(group_views <= 0))
                raise ValueError(f"sample {empty} of group {group} has no view; every sample needs one")
            group_counts = np.asarray(group_counts, dtype=np.int64)
            if group_counts.size and int(group_counts.min()) < 0:
                raise ValueError(f"view_token_counts[{group}] holds a negative count; counts are packed sizes")
            offsets.append(group_offsets[1:] + count_base)
            tokens.append(group_counts)
            base.append(base[-1] + len(group_views))
            count_base += len(group_counts)
            max_views = max(max_views, int(group_views.max()))
        return cls(np.array(base, dtype=np.int64), np.concatenate(tokens), np.concatenate(offsets), max_views)


def _group_keys(seed: int, num_groups: int) -> np.ndarray:
    """Each group's permutation key, from ``SeedSequence([seed, group])``."""
    return np.concatenate([np.random.SeedSequence([seed, g]).generate_state(1, np.uint64) for g in range(num_groups)])
