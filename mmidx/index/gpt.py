"""Megatron's GPT indices, bit for bit and faster: ``gpt_indices`` and its parts ``build_document_index``,
``build_sample_index``, ``build_shuffle_index``.

Guarantee: for the same sequence lengths, exposed documents, sequence length, requested number of samples,
seed, ``add_extra_token`` and ``drop_last``, each array and its dtype equal what megatron-core 0.16's
``GPTDataset._build_document_sample_shuffle_indices`` builds: the number of epochs, the separate final epoch
(when it would hold fewer than ``int(0.80 * samples per epoch)`` samples), the document index shuffled by
``RandomState(seed)`` in Megatron's order, helpers.cpp's sample index (including its single-precision ``ceil``
without drop_last and its end-of-documents rows) and the shuffle index. Beyond Megatron's limits the same
rules carry on in 64 bits where Megatron would wrap around: int64 sequence lengths, document ids >= 2**31.

Speed: numpy's ``RandomState.shuffle`` is redone as a typed Fisher-Yates on the same bit generator (same
permutation, same generator state after) that draws its swap targets ahead and prefetches them, and the
sample-index loop runs without the GIL, prefetching document sizes (``csrc/_index.pyx``). Every function is
a pure function of its arguments (a ``RandomState`` argument counts as one: it is consumed exactly as
Megatron consumes it).
"""

from __future__ import annotations

import numpy as np

from mmidx import _index

_INT32_MAX = int(np.iinfo(np.int32).max)


_UINT32_MAX = int(np.iinfo(np.uint32).max)


_UNSIGNED_OF_ITEMSIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# Megatron separates the final epoch when it would hold fewer than this share of an epoch's samples.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


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
