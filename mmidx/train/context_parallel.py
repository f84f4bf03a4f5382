"""Context parallelism's split of a packed sequence, the way Megatron-Core and Transformer Engine split it.

Under context parallelism (CP) every rank of a CP group holds the same pack and computes attention for one shard
of its tokens. With causal attention the last tokens attend to the most keys, so Megatron cuts the sequence into
``2·cp`` equal chunks and gives rank ``r`` chunks ``r`` and ``2·cp − 1 − r`` (a zigzag: each rank gets one cheap
and one dear chunk):

* per sequence: the whole pack is cut so (``megatron.core.utils.get_batch_on_this_cp_rank``):
  :func:`zigzag_sequence`;
* per document: each sub-sequence of a THD pack is cut into ``2·cp`` chunks of its own, the semantics of
  Transformer Engine's ``thd_get_partitioned_indices``, so that every document is balanced, not only the pack:
  :func:`zigzag_documents` (token positions), :func:`split_documents` (tensors).

Both need lengths divisible by ``2·cp``, and sequence parallelism also needs the shard of each rank divisible by
the tensor-parallel size: :func:`padding_multiple` is the multiple each sub-sequence is padded to,
:func:`padded_lengths` the lengths after padding. The split is a function, so a trainer can split in its loader
(each CP rank then receives only its shard) instead of in the model, and :func:`merge_documents` puts the shards
back together (what tests check: the shards of every rank give back the pack).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def padding_multiple(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """The multiple every sub-sequence's length is padded to at context-parallel size ``cp``: ``2·cp`` chunks of
    equal length for the zigzag (1 without CP), and, with sequence parallelism, each rank's shard divisible by the
    tensor-parallel size ``tp`` (so ``lcm(2·cp, cp·tp)``)."""
    if cp < 1 or tp < 1:
        raise ValueError(f"context- and tensor-parallel sizes must be >= 1, got cp={cp}, tp={tp}")
    multiple = 2 * cp if cp > 1 else 1
    return math.lcm(multiple, cp * tp) if sequence_parallel else multiple


def padded_lengths(lengths: Sequence[int] | np.ndarray, multiple: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``multiple`` (int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if multiple < 1 or (lengths < 0).any():
        raise ValueError(f"need a multiple >= 1 and lengths >= 0, got {multiple} and {lengths.min(initial=0)}")
    return -(-lengths // multiple) * multiple


def _check(cp: int, rank: int) -> None:
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"need 0 <= rank < cp, got rank {rank} of cp {cp}")


def zigzag_sequence(value: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``value`` along ``dim`` (whose length is a multiple of ``2·cp``): chunks ``rank``
    and ``2·cp − 1 − rank`` of ``2·cp``, concatenated; what ``get_batch_on_this_cp_rank`` gives for the key."""
    _check(cp, rank)
    if cp == 1:
        return value
    length = value.shape[dim]
    if length % (2 * cp):
        raise ValueError(f"a length of {length} does not split into {2 * cp} equal chunks: pad it to a multiple of "
                         f"{2 * cp} (padding_multiple)")
    chunks = value.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def zigzag_documents(cu_seqlens_padded: Sequence[int] | np.ndarray | torch.Tensor, cp: int,
                     rank: int) -> np.ndarray:
    """The token positions (int64, rising) of rank ``rank``'s shard of a THD pack whose sub-sequences start at
    ``cu_seqlens_padded`` (each padded length a multiple of ``2·cp``): of each sub-sequence, its chunks ``rank``
    and ``2·cp − 1 − rank`` of ``2·cp`` (Transformer Engine's ``thd_get_partitioned_indices``); every position
    at ``cp`` 1."""
    _check(cp, rank)
    bounds = np.asarray(torch.as_tensor(cu_seqlens_padded).cpu(), dtype=np.int64)
    lengths = np.diff(bounds)
    if bounds.ndim != 1 or bounds.size < 1 or bounds[0] != 0 or (lengths < 0).any():
        raise ValueError("cu_seqlens_padded must rise from 0")
    if cp == 1:  # one rank holds the whole pack
        return np.arange(int(bounds[-1]), dtype=np.int64)
    if (lengths % (2 * cp)).any():
        bad = int(lengths[(lengths % (2 * cp)) != 0][0])
        raise ValueError(f"a sub-sequence of {bad} tokens does not split into {2 * cp} equal chunks: pad each to a "
                         f"multiple of {2 * cp} (padding_multiple)")
    chunk = lengths // (2 * cp)
    starts = np.stack([bounds[:-1] + rank * chunk, bounds[:-1] + (2 * cp - 1 - rank) * chunk], axis=1).ravel()
    sizes = np.repeat(chunk, 2)  # each sub-sequence's two chunks, in order
    return np.repeat(starts, sizes) + np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)


def split_documents(value: torch.Tensor, cu_seqlens_padded: Sequence[int] | np.ndarray | torch.Tensor, cp: int,
                    rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``value`` along ``dim`` (the THD token dimension): :func:`zigzag_documents`."""
    positions = torch.from_numpy(zigzag_documents(cu_seqlens_padded, cp, rank)).to(value.device)
    return value.index_select(dim, positions)


def merge_documents(shards: Sequence[torch.Tensor], cu_seqlens_padded: Sequence[int] | np.ndarray | torch.Tensor,
                    dim: int = 1) -> torch.Tensor:
    """The pack back from every CP rank's shard (``shards[r]``: rank ``r``'s :func:`split_documents`)."""
    cp = len(shards)
    total = int(torch.as_tensor(cu_seqlens_padded)[-1])
    shape = list(shards[0].shape)
    shape[dim] = total
    out = shards[0].new_empty(shape)
    for rank, shard in enumerate(shards):
        positions = torch.from_numpy(zigzag_documents(cu_seqlens_padded, cp, rank)).to(shard.device)
        out.index_copy_(dim, positions, shard)
    return out
