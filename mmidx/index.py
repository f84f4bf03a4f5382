"""Sample indices: Megatron's GPT indices and blends, bit for bit and faster; multimodal packing.

Every function here is a pure function of its arguments (a ``RandomState`` argument counts as one:
it is consumed exactly as Megatron consumes it). The Cython kernels live in ``csrc/``.

Megatron GPT indices — ``gpt_indices`` and its parts ``build_document_index``,
``build_sample_index``, ``build_shuffle_index``.
    Guarantee: for the same sequence lengths, exposed documents, sequence length, requested number
    of samples, seed, ``add_extra_token`` and ``drop_last``, each array and its dtype equal what
    megatron-core 0.16's ``GPTDataset._build_document_sample_shuffle_indices`` builds: the number of
    epochs, the separate final epoch (when it would hold fewer than ``int(0.80 * samples per
    epoch)`` samples), the document index shuffled by ``RandomState(seed)`` in Megatron's order,
    helpers.cpp's sample index (including its single-precision ``ceil`` without drop_last and its
    end-of-documents rows) and the shuffle index. Beyond Megatron's limits the same rules carry on
    in 64 bits where Megatron would wrap around: int64 sequence lengths, document ids >= 2**31.
    Speed: numpy's ``RandomState.shuffle`` is redone as a typed Fisher-Yates on the same bit
    generator (same permutation, same generator state after) that draws its swap targets ahead and
    prefetches them, and the sample-index loop runs without the GIL, prefetching document sizes.

Blending — ``blending_indices``, ``exhaustive_blending_indices``.
    Guarantee: equal to helpers.cpp's ``build_blending_indices`` / ``build_exhaustive_blending_indices``
    as ``BlendedDataset`` calls them (weights normalised by ``w / sum(w)`` in float64): sample s
    goes to the dataset with the largest ``weight * max(s, 1) - taken``, ties to the lowest index.
    Sample counters are int64; the dataset index is int16 up to 32,767 datasets (as Megatron's) and
    int32 beyond, where Megatron stops.

Multimodal stream — ``multimodal_stream``, ``stream_views``.
    Guarantee: the group order is the greedy blend above; the j-th item taken from group g is
    sample ``P(g, e)[j % n_g]`` of epoch ``e = j // n_g``, where ``P(g, e)`` is a keyed
    pseudo-random permutation of the group's n_g samples (a cycle-walked Feistel network keyed by
    ``SeedSequence([seed, g])`` and e; ``csrc/_stream.pyx``). Each epoch visits every sample once, a
    partial last epoch is a pseudo-random subset shuffled apart, a longer stream extends a shorter
    one, and no array of size n_g is ever built: O(1) memory per group, whatever its size (a
    ``numpy`` permutation per epoch would need n_g int64s for every epoch touched). Token counts
    follow DESIGN's views: epoch e of a sample with K views uses view ``e mod K``, so every count is
    exact before any data is read.

Packing — ``pack_samples``.
    Guarantee: every item is either in exactly one pack or in ``excluded`` (over the per-sample
    limit); no pack holds more than ``max_num_tokens``; packs are a pure function of the inputs
    (no RNG); each pack starts with one item of every mandatory group, in group order (except solo
    packs, exhausted groups, or a mandatory item that does not fit beside the earlier ones); the
    deferral buffer never holds more than ``max_buffer_size + 1`` items. O(n log B) time. The rules
    are spelled out in ``pack_samples``.

Streamed packing — ``PackStream``.
    Guarantee: the packs of ``multimodal_stream`` → ``stream_views`` → ``pack_samples``, item for
    item (as sample numbers and views), computed a chunk at a time: the blend's counts, the
    packer's buffer, open pack and mandatory queues carry over chunk boundaries, so memory is the
    chunk and the view tables, whatever the stream's length.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmidx import _blending, _index, _packing, _stream

_INT32_MAX = int(np.iinfo(np.int32).max)
_UINT32_MAX = int(np.iinfo(np.uint32).max)
_UNSIGNED_OF_ITEMSIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# Megatron separates the final epoch when it would hold fewer than this share of an epoch's samples.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


# --------------------------------------------------------------------------------------------------
# Megatron GPT indices


def legacy_shuffle(random_state: np.random.RandomState, array: np.ndarray) -> None:
    """Shuffle ``array`` in place exactly as ``random_state.shuffle(array)`` does, only faster.

    Same permutation, and ``random_state`` ends in the same state, so draws made after it agree
    with Megatron's too. ``array`` must be a writeable, C-contiguous 1-D array of 1-, 2-, 4- or
    8-byte elements.
    """
    if not isinstance(random_state, np.random.RandomState):
        raise TypeError(
            f"legacy_shuffle reproduces numpy.random.RandomState.shuffle; got {type(random_state).__name__}"
        )
    if not isinstance(array, np.ndarray) or array.ndim != 1 or not array.flags.c_contiguous:
        raise ValueError(
            "legacy_shuffle needs a C-contiguous 1-D numpy array; shuffle numpy.ascontiguousarray(x) "
            "and use that copy"
        )
    if not array.flags.writeable:
        raise ValueError("legacy_shuffle shuffles in place, but the array is read-only; pass a copy")
    unsigned = _UNSIGNED_OF_ITEMSIZE.get(array.itemsize)
    if unsigned is None or array.dtype.hasobject:
        raise TypeError(
            f"legacy_shuffle handles plain 1-, 2-, 4- or 8-byte elements, not {array.dtype}; use "
            "random_state.shuffle for this array"
        )
    _index.legacy_shuffle(random_state, array.view(unsigned))


def build_document_index(
    documents: np.ndarray,
    num_epochs: int,
    random_state: np.random.RandomState,
    separate_final_epoch: bool,
) -> np.ndarray:
    """Megatron's ``_build_document_index``: ``documents`` repeated ``num_epochs`` times, shuffled.

    With ``separate_final_epoch`` the first ``num_epochs - 1`` epochs are shuffled together and the
    last one on its own, after them, from the same ``random_state``. int32 like Megatron's, int64
    when a document id does not fit int32 (Megatron would wrap it around).
    """
    documents = np.asarray(documents)
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be at least 1, got {num_epochs}")
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, random_state, False)
        last = build_document_index(documents, 1, random_state, False)
        return np.concatenate((first, last))
    wide = documents.size > 0 and int(documents.max()) > _INT32_MAX
    document_index = np.tile(documents.astype(np.int64 if wide else np.int32), num_epochs)
    legacy_shuffle(random_state, document_index)
    return document_index


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    *,
    drop_last: bool = True,
    add_extra_token: bool = True,
) -> np.ndarray:
    """Megatron's ``helpers.build_sample_idx``: where each sample starts in the document stream.

    Row k is (position in ``document_index``, token offset in that document) of sample k's first
    token; sample k spans ``seq_length + add_extra_token`` tokens and sample k + 1 starts
    ``seq_length`` tokens after it. int32 when ``max(len(document_index), max(sizes))`` fits int32,
    else int64, as Megatron chooses. ``sizes`` may be int32 (Megatron's) or int64.
    """
    sizes = _as_int32_or_int64(sizes, "sizes")
    document_index = _as_int32_or_int64(document_index, "document_index")
    if seq_length <= 1:
        raise ValueError(f"seq_length must be greater than 1, got {seq_length}")
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be at least 1, got {num_epochs}")
    if tokens_per_epoch <= 1:
        raise ValueError(f"an epoch must hold more than one token, got tokens_per_epoch={tokens_per_epoch}")
    if sizes.size == 0 or document_index.size == 0:
        raise ValueError("sizes and document_index must not be empty: there are no tokens to sample")
    extra = int(bool(add_extra_token))
    num_samples = _index.sample_count(num_epochs, tokens_per_epoch, seq_length, bool(drop_last), extra)
    widest = max(len(document_index), int(sizes.max()))
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int32 if widest <= _INT32_MAX else np.int64)
    bad = _index.build_sample_index(sizes, document_index, seq_length, extra, sample_index)
    if bad >= 0:
        raise IndexError(
            f"document_index[{bad}] = {document_index[bad]} is not a document of sizes (which has "
            f"{len(sizes)}); the document index must hold ids in [0, {len(sizes)})"
        )
    if sample_index[-1, 1] < 0:
        # helpers.cpp writes offset -1 here and Megatron's wrapper stops on an assertion.
        raise ValueError(
            "without drop_last the samples run past the end of the documents, and the last document "
            "of the document index is empty, so the last sample would start at offset -1; use "
            "drop_last=True or leave empty documents out"
        )
    return sample_index


def build_shuffle_index(
    num_samples: int, total_size: int, random_state: np.random.RandomState
) -> np.ndarray:
    """Megatron's ``_build_shuffle_index``: [0, num_samples) shuffled, then [num_samples,
    total_size) shuffled on its own (the separate final epoch stays last).

    uint32, or int64 once ``total_size >= 2**32 - 2``, as Megatron chooses.
    """
    dtype = np.int64 if total_size >= _UINT32_MAX - 1 else np.uint32
    first = np.arange(0, num_samples, dtype=dtype)
    legacy_shuffle(random_state, first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    legacy_shuffle(random_state, last)
    return np.concatenate((first, last))


def gpt_indices(
    sizes: np.ndarray,
    *,
    seq_length: int,
    num_samples: int | None,
    seed: int,
    add_extra_token: bool = True,
    drop_last: bool = True,
    documents: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) exactly as Megatron's GPTDataset builds them.

    ``sizes`` are the dataset's ``sequence_lengths``, ``documents`` the exposed document ids (its
    ``indices``; all by default), ``num_samples`` the requested samples (None: one epoch),
    ``seed`` its ``config.random_seed``, ``add_extra_token`` its ``add_extra_token_to_sequence`` and
    ``drop_last`` its ``drop_last_partial_sequence`` (True except for validation splits).
    """
    if seq_length <= 1:
        raise ValueError(f"seq_length must be greater than 1, got {seq_length}")
    sizes = _as_int32_or_int64(sizes, "sizes")
    documents = np.arange(len(sizes)) if documents is None else np.asarray(documents)
    if documents.ndim != 1 or documents.size == 0:
        raise ValueError("documents must be a non-empty 1-D array of document ids")
    if int(documents.min()) < 0 or int(documents.max()) >= len(sizes):
        raise IndexError(f"documents must be ids in [0, {len(sizes)}), the range of sizes")
    if num_samples is not None and num_samples < 0:
        raise ValueError(f"num_samples must be non-negative or None, got {num_samples}")
    extra = int(bool(add_extra_token))
    tokens_per_epoch = int(np.sum(sizes[documents]))
    if tokens_per_epoch <= extra:
        raise ValueError(
            f"the exposed documents hold {tokens_per_epoch} tokens, too few for one sample; "
            "check sizes and documents"
        )

    num_epochs = 1
    if num_samples is not None:
        tokens_requested = num_samples * seq_length + extra
        num_epochs = max(1, -(-tokens_requested // tokens_per_epoch))

    separate_final_epoch = False
    if num_epochs > 1:
        num_samples_sans_final_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
        num_samples_per_epoch = (tokens_per_epoch - extra) // seq_length
        num_samples_from_final_epoch = num_samples - num_samples_sans_final_epoch
        separate_final_epoch = num_samples_from_final_epoch < int(
            SEPARATE_FINAL_EPOCH_THRESHOLD * num_samples_per_epoch
        )

    random_state = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, random_state, separate_final_epoch)
    sample_index = build_sample_index(
        sizes,
        document_index,
        seq_length,
        num_epochs,
        tokens_per_epoch,
        drop_last=drop_last,
        add_extra_token=add_extra_token,
    )
    total = sample_index.shape[0] - 1
    first_range = num_samples_sans_final_epoch if separate_final_epoch else total
    shuffle_index = build_shuffle_index(first_range, total, random_state)
    return document_index, sample_index, shuffle_index


def _as_int32_or_int64(values: np.ndarray, name: str) -> np.ndarray:
    """A contiguous 1-D int32 or int64 array (other integer dtypes widened to int64)."""
    array = np.asarray(values)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must be a 1-D array of integers, got {array.dtype} of shape {array.shape}")
    if array.dtype not in (np.int32, np.int64):
        array = array.astype(np.int64)
    return np.ascontiguousarray(array)


# --------------------------------------------------------------------------------------------------
# Blending


def blending_indices(weights: np.ndarray | list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) of a ``size``-sample blend, as Megatron's BlendedDataset.

    Sample s comes from dataset ``dataset_index[s]`` and is its ``dataset_sample_index[s]``-th
    sample; weights are normalised like Megatron's ``normalize`` (the builder normalises once more
    before BlendedDataset; pass it its normalised weights to match that path exactly).
    """
    normalised = _normalize(weights)
    if size < 0:
        raise ValueError(f"size must be non-negative, got {size}")
    dataset_index = np.empty(size, dtype=_dataset_index_dtype(len(normalised)))
    dataset_sample_index = np.empty(size, dtype=np.int64)
    _blending.build_blending_indices(normalised, dataset_index, dataset_sample_index, np.zeros(len(normalised)), 0)
    return dataset_index, dataset_sample_index


def exhaustive_blending_indices(sizes: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) taking exactly ``sizes[d]`` samples of each dataset d,
    interleaved in proportion to the sizes, as Megatron's BlendedDataset with ``size=None``."""
    counts = np.asarray(sizes)
    if counts.ndim != 1 or counts.size == 0 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError("sizes must be a non-empty 1-D array of sample counts")
    if int(counts.min()) <= 0:
        raise ValueError("every dataset of an exhaustive blend needs at least one sample; drop empty ones")
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    total = int(counts.sum())
    dataset_index = np.empty(total, dtype=_dataset_index_dtype(len(counts)))
    dataset_sample_index = np.empty(total, dtype=np.int64)
    _blending.build_exhaustive_blending_indices(counts, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def _normalize(weights: np.ndarray | list[float]) -> np.ndarray:
    """Megatron's ``normalize``: ``w / sum(w)`` in float64, after checking the weights."""
    w = np.array(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError("weights must be a non-empty 1-D sequence, one weight per dataset")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError("weights must be finite and positive; leave out the datasets you do not want")
    return w / np.sum(w)


def _dataset_index_dtype(num_datasets: int) -> type:
    return np.int16 if num_datasets <= np.iinfo(np.int16).max else np.int32


# --------------------------------------------------------------------------------------------------
# Multimodal stream


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
    _stream.item_views(group_ids, sample_ids, epochs, table.group_base, table.view_offsets, table.view_tokens, 1,
                       views, counts, np.empty(0, np.int64))
    return views, counts


@dataclass(frozen=True)
class ViewTable:
    """Every group's per-sample view sizes, laid end to end: samples are numbered across groups
    (group g's sample s is ``group_base[g] + s``), and the views of sample i are
    ``view_tokens[view_offsets[i]:view_offsets[i + 1]]``."""

    group_base: np.ndarray
    view_offsets: np.ndarray
    view_tokens: np.ndarray

    @property
    def num_groups(self) -> int:
        return len(self.group_base) - 1

    @property
    def max_views(self) -> int:
        return int(np.diff(self.view_offsets).max())

    @classmethod
    def of(cls, view_offsets: list[np.ndarray], view_token_counts: list[np.ndarray]) -> ViewTable:
        """From per-group (view_offsets, view_token_counts), checking that every sample has a view."""
        if len(view_offsets) != len(view_token_counts) or not view_offsets:
            raise ValueError("view_offsets and view_token_counts must have one entry per group")
        offsets, tokens, base, count_base = [np.zeros(1, np.int64)], [], [0], 0
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
        return cls(np.array(base, dtype=np.int64), np.concatenate(offsets), np.concatenate(tokens))


# --------------------------------------------------------------------------------------------------
# Packing


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
    """
    _check_budgets(max_num_tokens, expected_num_tokens, max_num_tokens_per_sample, prefer_buffer_before,
                   max_buffer_size)
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
                     prefer_buffer_before, max_buffer_size, len(counts))
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


def _packer(mandatory: np.ndarray, *budgets: int) -> _packing.Packer:
    return _packing.Packer(np.ascontiguousarray(mandatory, dtype=bool).view(np.uint8), *budgets)


def _check_kernel(bad: int, name: str, counts: np.ndarray) -> None:
    if bad >= 0:
        raise ValueError(f"{name}[{bad}] = {counts[bad]} is negative")


def packing_stats(packer: _packing.Packer, max_num_tokens: int, expected_num_tokens: int) -> dict[str, Any]:
    """The packer's counters: packs, items, exclusions, deferrals, solo packs and fill."""
    num_packs = packer.num_packs
    mean_tokens = packer.tokens / num_packs if num_packs else 0.0
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
    }


# --------------------------------------------------------------------------------------------------
# Streamed packing: the stream and the packer a chunk at a time


@dataclass(frozen=True)
class PackChunk:
    """Packs closed while the stream advanced by one chunk: pack k of the chunk holds items
    ``pack_ends[k-1]:pack_ends[k]`` of ``samples`` / ``views`` (numbered as in the ViewTable)."""

    samples: np.ndarray
    views: np.ndarray
    pack_ends: np.ndarray
    tokens: int
    excluded: int
    stream_position: int


class _Cursor:
    """A place in the blended stream: its position and the blend's per-group counts so far."""

    def __init__(self, position: int, taken: np.ndarray):
        self.position = position
        self.taken = taken

    def copy(self) -> _Cursor:
        return _Cursor(self.position, self.taken.copy())


class PackStream:
    """The packs of ``multimodal_stream`` → ``stream_views`` → ``pack_samples``, computed a chunk of
    the stream at a time in memory bounded by the chunk size (and the view table), equal to that
    whole-array pipeline pack for pack. Iterate for ``PackChunk`` s; ``stats`` afterwards.

    A mandatory group whose next item lies beyond the current chunk is read ahead by a cursor of its
    own, a chunk at a time, keeping only that group's items: its queue never holds more than a
    chunk's worth of them.
    """

    def __init__(self, table: ViewTable, weights: np.ndarray | list[float], num_samples: int, seed: int, *,
                 mandatory: np.ndarray | list[bool], max_num_tokens: int, expected_num_tokens: int,
                 max_num_tokens_per_sample: int, prefer_buffer_before: int, max_buffer_size: int,
                 chunk_size: int = 1 << 20):
        self.table = table
        self.weights = _normalize(weights)
        if len(self.weights) != table.num_groups or len(mandatory) != table.num_groups:
            raise ValueError("weights, mandatory and the view table need one entry per group")
        if num_samples < 0 or chunk_size < 1:
            raise ValueError(f"num_samples must be >= 0 and chunk_size >= 1, got {num_samples}, {chunk_size}")
        self.num_samples = int(num_samples)
        self.chunk_size = int(chunk_size)
        self.group_sizes = np.diff(table.group_base)
        self.group_keys = _group_keys(seed, table.num_groups)
        self.key_stride = table.max_views
        self.mandatory = np.asarray(mandatory, dtype=bool)
        _check_budgets(max_num_tokens, expected_num_tokens, max_num_tokens_per_sample, prefer_buffer_before,
                       max_buffer_size)
        self.budgets = (max_num_tokens, expected_num_tokens)
        self.packer = _packer(self.mandatory, max_num_tokens, expected_num_tokens, max_num_tokens_per_sample,
                              prefer_buffer_before, max_buffer_size, self.num_samples)
        self.stats: dict[str, Any] = {}
        self.group_counts: list[int] = []  # stream items of each group, once iterated

    def _chunk(self, cursor: _Cursor, length: int, only: int | None = None) -> tuple[np.ndarray, ...]:
        """(groups, token counts, keys) of the next ``length`` stream items (of group ``only``)."""
        groups = np.empty(length, dtype=np.int32)
        ranks = np.empty(length, dtype=np.int64)
        _blending.build_blending_indices(self.weights, groups, ranks, cursor.taken, cursor.position)
        cursor.position += length
        if only is not None:
            chosen = groups == only
            groups, ranks = groups[chosen], ranks[chosen]
        n = len(groups)
        samples, epochs = np.empty(n, np.int64), np.empty(n, np.int64)
        _stream.stream_samples(groups, ranks, self.group_sizes, self.group_keys, samples, epochs)
        views, counts, keys = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int64)
        t = self.table
        _stream.item_views(groups, samples, epochs, t.group_base, t.view_offsets, t.view_tokens, self.key_stride,
                           views, counts, keys)
        return groups, counts, keys

    def _lookahead(self, cursor: _Cursor, groups: np.ndarray, counts: np.ndarray, keys: np.ndarray,
                   take: np.ndarray) -> None:
        _check_kernel(self.packer.lookahead(counts, groups, keys, take.view(np.uint8)), "view token counts", counts)
        if cursor.position == self.num_samples:
            for group in np.flatnonzero(take):
                self.packer.end_lookahead(int(group))

    def __iter__(self) -> Iterator[PackChunk]:
        packer = self.packer
        main = _Cursor(0, np.zeros(self.table.num_groups))
        mandatory = np.flatnonzero(self.mandatory)
        ahead = {int(g): main.copy() for g in mandatory}  # where each group's lookahead has reached
        while main.position < self.num_samples:
            start = main.position
            groups, counts, keys = self._chunk(main, min(self.chunk_size, self.num_samples - start))
            take = np.zeros(self.table.num_groups, dtype=bool)
            for group, cursor in ahead.items():
                if cursor.position == start:
                    take[group] = True
                    ahead[group] = main.copy()
            if take.any():
                self._lookahead(main, groups, counts, keys, take)
            begin = 0
            while True:
                begin, needed = packer.feed(counts, groups, keys, start, begin)
                if needed == -1:
                    break
                if needed < -1:
                    raise ValueError(f"stream item {-2 - needed} has a negative view token count")
                cursor = ahead[needed]
                only = self._chunk(cursor, min(self.chunk_size, self.num_samples - cursor.position), needed)
                self._lookahead(cursor, *only, take=np.arange(self.table.num_groups) == needed)
            yield self._drain(main.position)
        for group in mandatory:  # an empty stream never reached the lookahead
            packer.end_lookahead(int(group))
        packer.finish()
        yield self._drain(main.position)
        self.stats = packing_stats(packer, *self.budgets)
        self.group_counts = main.taken.astype(np.int64).tolist()

    def _drain(self, position: int) -> PackChunk:
        keys, ends, tokens, excluded = self.packer.drain()
        samples, views = np.divmod(keys, self.key_stride)
        return PackChunk(samples, views, ends, int(tokens.sum()), len(excluded), position)


def _group_keys(seed: int, num_groups: int) -> np.ndarray:
    """Each group's permutation key, from ``SeedSequence([seed, group])``."""
    return np.concatenate([np.random.SeedSequence([seed, g]).generate_state(1, np.uint64) for g in range(num_groups)])
