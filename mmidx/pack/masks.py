"""Attention masks of a BAGEL packed batch, built on the batch's device (CPU or CUDA).

The rule
--------
A pack is a run of *samples*; a sample is a run of consecutive *splits*; every split has an
attention mode, ``"causal"``, ``"full"`` or ``"noise"``. Within a sample (BAGEL, three steps):

1. a causal split attends lower-triangularly within itself, plus every earlier split;
2. a full or noise split attends to its whole own block, plus every earlier split;
3. then the columns of every noise split are hidden from every row outside that split.

Across samples nothing attends. Inputs are BAGEL's flex-mode keys: ``split_lens`` and
``attn_modes`` (every split of the pack, in order) and ``sample_lens``.

One predicate
-------------
The rule is implemented once, as a FlexAttention ``mask_mod`` over three per-token keys::

    allowed(q, k)  <=>  k < row_limit[q]  and  col_key[k] >= row_start[q]

    row_start[q] = first token of q's split
    row_limit[q] = q + 1 if q's split is causal, else the end of q's split
    col_key[k]   = k if k's split is noise, else the last token of k's sample

Why this is the rule, for q in split j and k in split m: if m comes after j (or k lies in a later
sample), ``k >= end of j >= row_limit[q]``. If m is j, ``col_key[k] >= row_start[q]`` holds, so
``k < row_limit[q]`` gives the triangle (causal) or the whole block (full, noise). If m is an
earlier split of the sample, ``k < row_limit[q]`` holds and ``col_key[k] >= row_start[q]`` holds
exactly when m is not noise (its ``col_key`` is the sample's last token, else ``k`` itself, which
is before q's split). If k lies in an earlier sample, ``col_key[k]`` is before q's sample.

Dense masks
-----------
All rows of a split share ``row_start``, and their ``row_limit`` grows with q, so every row of a
split equals the predicate at the split's *last* row, except that a causal row q also stops at
q (``row_limit[q] = q + 1``): the strict upper triangle of the split's diagonal block. Each row is
therefore a few runs of one value: over every earlier split of the sample, 0 (-inf where that split
is noise); 0 from the row's split start to its ``row_limit``; -inf to the end of the row.

On the CPU a Cython kernel (``csrc/_masks.pyx``) stores exactly those runs, row by row, with streaming
stores, reading nothing: a mask costs about what storing its bytes costs (``benchmarks/bench_masks.py``).
Most of what filling fresh memory costs is paging it in, so a pack's masks are written into a buffer reused
once none of them is alive (``mmidx.pack.buffers.mask_buffer``). On other devices the predicate at each
split's last row gives a small (splits × L_i) template, ``index_select`` copies the template row of every
token's split into the (L_i, L_i) output, and each causal diagonal block gets its upper triangle blocked;
no (L_i, L_i) temporary exists besides the output. Both are checked bit for bit against the rule.

Block classification (``block_mask``)
-------------------------------------
Cut [0, L) at every block boundary and at every split start into *pieces*: each piece lies in one
block and one split. On a *tile* (row piece × column piece) ``row_start`` is constant,
``row_limit`` non-decreasing in q and ``col_key`` non-decreasing in k, so the predicate is
monotone there and two or three points decide the whole tile:

* full      <=> allowed(first row, first column) and allowed(first row, last column);
* non-empty <=> allowed(last row, k*), k* = max(first column, min(last column, row_limit - 1)).

A block is *full* when its full tiles cover block_size² positions (so the blocks at the end of a
sequence that is not a multiple of the block size, which FlexAttention pads with masked
positions, never are), *partial* when it has a non-empty tile and is not full, and *empty*
otherwise: exactly ``create_block_mask``'s classification. Only tiles whose row and column pieces
lie in the same sample can be non-empty, so only those are enumerated (vectorised on the device):
about (L / block_size + splits) × (sample length / block_size + splits per sample) tiles, never a
per-position evaluation. The block lists are ordered as ``create_block_mask`` orders them
(non-empty blocks ascending, then the others ascending), with cumulative sums, not a sort.

Host and device
---------------
Split metadata is small and arrives as Python lists: it is validated and cut into pieces on the
host with numpy (output shapes depend on it), then copied to the device in one or two small
transfers; everything per token, per tile and per block is computed on the device without reading
device values back (no ``.item()``, sizes passed as ``output_size``).
Tensors given as ``split_lens``/``sample_lens`` are read to the host (on CUDA that is one copy).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from mmidx import _masks
from mmidx.pack.buffers import mask_buffer

__all__ = ["ATTN_MODES", "block_mask", "dense_masks", "mask_predicate"]

ATTN_MODES = ("causal", "full", "noise")

Lengths = Sequence[int] | np.ndarray | torch.Tensor
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Per-token keys and positions are int32, as FlexAttention's own indices are.
_MAX_LENGTH = 2**31 - 1


def _lengths(name: str, values: Lengths) -> np.ndarray:
    """``values`` as a 1-D int64 array of non-negative lengths, or a ValueError naming ``name``."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got a tensor of {values.dtype}")
        array = values.detach().cpu().numpy()
    else:
        array = np.asarray(values)
        if array.size == 0:
            array = array.astype(np.int64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(array.shape)}")
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got {array.dtype}")
    array = array.astype(np.int64)
    if (array < 0).any():
        raise ValueError(f"{name} must be non-negative, got {int(array.min())} at {int(array.argmin())}")
    return array


@dataclass(frozen=True)
class _Layout:
    """Validated split metadata on the host: non-empty splits only (empty ones attend to nothing)."""

    length: int
    starts: np.ndarray  # first token of every non-empty split
    ends: np.ndarray  # one past its last token
    causal: np.ndarray  # bool per non-empty split
    noise: np.ndarray  # bool per non-empty split
    split_sample: np.ndarray  # sample index of every non-empty split
    sample_starts: np.ndarray  # every sample, empty ones included
    sample_ends: np.ndarray

    @classmethod
    def build(cls, split_lens: Lengths, attn_modes: Sequence[str], sample_lens: Lengths) -> _Layout:
        lens = _lengths("split_lens", split_lens)
        sample_lens_ = _lengths("sample_lens", sample_lens)
        if isinstance(attn_modes, str):
            raise ValueError(f"attn_modes must be a sequence of modes, one per split, got {attn_modes!r}")
        modes = list(attn_modes)
        if len(modes) != len(lens):
            raise ValueError(
                f"split_lens has {len(lens)} entries but attn_modes has {len(modes)}: give one mode per split"
            )
        for index, mode in enumerate(modes):
            if mode not in ATTN_MODES:
                raise ValueError(f"attn_modes[{index}] is {mode!r}; each mode must be one of {ATTN_MODES}")
        length = int(lens.sum())
        if int(sample_lens_.sum()) != length:
            raise ValueError(
                f"split_lens sum to {length} but sample_lens sum to {int(sample_lens_.sum())}; "
                "both must equal the packed sequence length"
            )
        if length > _MAX_LENGTH:
            raise ValueError(f"the packed length {length} exceeds {_MAX_LENGTH}")
        split_ends = np.cumsum(lens)
        sample_ends = np.cumsum(sample_lens_)
        inside = ~np.isin(sample_ends, split_ends) & (sample_ends > 0)
        if inside.any():
            raise ValueError(
                f"sample {int(inside.argmax())} ends at token {int(sample_ends[inside.argmax()])}, inside a "
                "split; every sample must be a run of whole splits"
            )
        kept = lens > 0
        mode_codes = np.array([ATTN_MODES.index(mode) for mode in modes], dtype=np.int8)[kept]
        starts = (split_ends - lens)[kept]
        return cls(
            length=length,
            starts=starts,
            ends=split_ends[kept],
            causal=mode_codes == ATTN_MODES.index("causal"),
            noise=mode_codes == ATTN_MODES.index("noise"),
            split_sample=np.searchsorted(sample_ends, starts, side="right"),
            sample_starts=sample_ends - sample_lens_,
            sample_ends=sample_ends,
        )


class _Keys(NamedTuple):
    """The predicate's per-token keys on the device, plus what the dense builder needs."""

    row_start: torch.Tensor
    row_limit: torch.Tensor
    col_key: torch.Tensor
    split_last: torch.Tensor  # last token of every non-empty split
    local_split: torch.Tensor  # per token: its split's index among its sample's non-empty splits


def _keys(layout: _Layout, device: torch.device | str) -> _Keys:
    """Per-token keys, from one host-to-device copy of the per-split metadata."""
    first_split_of_sample = np.searchsorted(layout.split_sample, np.arange(len(layout.sample_ends)))
    per_split = np.stack(
        [
            layout.starts,
            layout.ends,
            layout.sample_ends[layout.split_sample] - 1,
            np.arange(len(layout.starts)) - first_split_of_sample[layout.split_sample],
            layout.causal,
            layout.noise,
            layout.ends - layout.starts,
        ]
    )
    per_split = torch.from_numpy(per_split.astype(np.int32)).to(device)
    start, end, sample_last, local_split, causal, noise = torch.repeat_interleave(
        per_split[:-1], per_split[-1], dim=1, output_size=layout.length
    )
    position = torch.arange(layout.length, dtype=torch.int32, device=per_split.device)
    return _Keys(
        row_start=start,
        row_limit=torch.where(causal.bool(), position + 1, end),
        col_key=torch.where(noise.bool(), position, sample_last),
        split_last=per_split[1] - 1,
        local_split=local_split,
    )


def _mask_mod(keys: _Keys) -> MaskMod:
    """The rule as a FlexAttention mask_mod over per-token keys (see the module docstring)."""
    row_start, row_limit, col_key = keys.row_start, keys.row_limit, keys.col_key

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx < row_limit[q_idx]) & (col_key[kv_idx] >= row_start[q_idx])

    return mask_mod


def mask_predicate(
    split_lens: Lengths, attn_modes: Sequence[str], sample_lens: Lengths, *, device: torch.device | str
) -> MaskMod:
    """The attention rule of a pack as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    Positions are in the packed sequence; it is True where query ``q_idx`` may attend to key
    ``kv_idx``. Its per-token keys live on ``device``, so it works under ``create_block_mask``,
    ``flex_attention`` and ``vmap`` there. ``block_mask`` uses this same predicate; pass it to
    ``create_block_mask`` to build a ``BlockMask`` the slow way.
    """
    return _mask_mod(_keys(_Layout.build(split_lens, attn_modes, sample_lens), device))


# The dtypes whose 0 and -inf the masks hold (BAGEL's float32; bfloat16 or float16 for the model).
_MASK_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def dense_masks(
    split_lens: Lengths,
    attn_modes: Sequence[str],
    sample_lens: Lengths,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """One additive (L_i, L_i) mask per sample (0 = attend, -inf = blocked), built on ``device``.

    Bit for bit BAGEL's ``nested_attention_masks`` (``prepare_attention_mask_per_sample``) when
    ``dtype`` is float32; float64, bfloat16 and float16 (for the model) hold the same 0 / -inf.
    On the CPU each mask is stored once as runs of its two values (module docstring), close to the
    cost of a memset of it, in a buffer reused once no mask of it is alive; elsewhere each is copied
    row by row from a small per-split template. Python loops run over samples (and causal splits
    off the CPU), never over tokens. Masks are contiguous and share no memory with one another.
    """
    if dtype not in _MASK_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _MASK_DTYPES))} (a floating dtype that holds "
                         f"-inf), got {dtype!r}")
    layout = _Layout.build(split_lens, attn_modes, sample_lens)
    if torch.device(device).type == "cpu":
        return _cpu_dense_masks(layout, dtype)
    return _device_dense_masks(layout, device, dtype)


def _sample_splits(layout: _Layout) -> list[slice]:
    """The non-empty splits of every sample, as slices of the layout's per-split arrays."""
    bounds = np.searchsorted(layout.split_sample, np.arange(len(layout.sample_ends) + 1)).tolist()
    return [slice(first, stop) for first, stop in itertools.pairwise(bounds)]


def _element_bits(value: float, dtype: torch.dtype) -> int:
    """The bytes of ``value`` in ``dtype``, repeated over 8 bytes, as an integer in the machine's byte order."""
    raw = torch.full((1,), value, dtype=dtype).view(torch.uint8).numpy().tobytes()
    return int.from_bytes(raw * (8 // len(raw)), sys.byteorder)


def _cpu_dense_masks(layout: _Layout, dtype: torch.dtype) -> list[torch.Tensor]:
    """The masks written by the run kernel into one reused buffer, each a tensor of its own slice."""
    lengths = (layout.sample_ends - layout.sample_starts).tolist()
    buffer = mask_buffer(sum(length * length for length in lengths) * dtype.itemsize)
    values = _element_bits(0.0, dtype), _element_bits(float("-inf"), dtype), dtype.itemsize
    causal, noise = layout.causal.view(np.uint8), layout.noise.view(np.uint8)
    masks, offset = [], 0
    for splits, start, length in zip(_sample_splits(layout), layout.sample_starts, lengths, strict=True):
        out = buffer[offset:offset + length * length * dtype.itemsize]
        _masks.fill_sample_mask(out, layout.ends[splits] - start, causal[splits], noise[splits], *values)
        if length:  # (an empty slice has stride 0, which torch cannot view as another dtype)
            masks.append(torch.from_numpy(out).view(dtype).view(length, length))
        else:
            masks.append(torch.empty((0, 0), dtype=dtype))
        offset += out.nbytes
    return masks


def _device_dense_masks(layout: _Layout, device: torch.device | str, dtype: torch.dtype) -> list[torch.Tensor]:
    """The masks copied on ``device`` from per-split template rows (module docstring)."""
    keys = _keys(layout, device)
    allowed = _mask_mod(keys)
    position = torch.arange(layout.length, dtype=torch.int32, device=keys.row_start.device)
    attend = torch.zeros((), dtype=dtype, device=position.device)
    blocked = torch.full((), float("-inf"), dtype=dtype, device=position.device)
    masks = []
    for splits, start, end in zip(_sample_splits(layout), layout.sample_starts, layout.sample_ends, strict=True):
        last_rows = keys.split_last[splits, None]
        template = torch.where(allowed(None, None, last_rows, position[None, start:end]), attend, blocked)
        mask = template.index_select(0, keys.local_split[start:end])
        causal = layout.causal[splits]
        causal_starts = (layout.starts[splits][causal] - start).tolist()
        causal_ends = (layout.ends[splits][causal] - start).tolist()
        for first, stop in zip(causal_starts, causal_ends, strict=True):
            mask[first:stop, first:stop].fill_(float("-inf")).triu_(1)
        masks.append(mask)
    return masks


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks, indices) of a (rows, cols) bool block matrix, as ``create_block_mask`` orders them.

    Each row lists its True columns ascending, then its False columns ascending (what a stable
    descending argsort gives), computed with cumulative sums instead of a sort.
    """
    counts = dense.to(torch.int64)
    before = counts.cumsum(-1) - counts  # True columns left of each column
    num_blocks = counts.sum(-1, keepdim=True)
    column = torch.arange(dense.shape[-1], device=dense.device)
    rank = torch.where(dense, before, num_blocks + column - before)
    indices = torch.empty_like(rank).scatter_(-1, rank, column.expand_as(rank))
    return num_blocks[None, None, :, 0].to(torch.int32), indices[None, None].to(torch.int32)


def block_mask(
    split_lens: Lengths,
    attn_modes: Sequence[str],
    sample_lens: Lengths,
    *,
    device: torch.device | str,
    block_size: int = 128,
) -> BlockMask:
    """The FlexAttention ``BlockMask`` of the whole pack, from the split metadata alone.

    Equal to ``create_block_mask(mask_predicate(...), None, None, L, L, device=device,
    BLOCK_SIZE=block_size)`` (same block lists, full and partial, same ``mask_mod``) but built by
    interval arithmetic on pieces of splits and blocks (module docstring): milliseconds and
    megabytes for a 32K-token pack, where ``create_block_mask`` evaluates all L² positions.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    layout = _Layout.build(split_lens, attn_modes, sample_lens)
    keys = _keys(layout, device)
    allowed = _mask_mod(keys)
    num_blocks = -(-layout.length // block_size)

    # Pieces, on the host: [0, L) cut at block boundaries and split starts; each lies in one sample.
    bounds = np.union1d(np.arange(0, layout.length, block_size), np.append(layout.starts, layout.length))
    piece_sample = np.searchsorted(layout.sample_ends, bounds[:-1], side="right")
    first_piece_of_sample = np.searchsorted(piece_sample, piece_sample, side="left")
    tiles_per_row = np.searchsorted(piece_sample, piece_sample, side="right") - first_piece_of_sample
    num_tiles = int(tiles_per_row.sum())
    per_piece = np.stack([bounds[:-1], bounds[1:] - 1, first_piece_of_sample, tiles_per_row])
    first, last, first_col, per_row = torch.from_numpy(per_piece).to(keys.row_start.device)

    # Tiles, on the device: every (row piece, column piece) pair within one sample.
    row = torch.repeat_interleave(
        torch.arange(len(piece_sample), device=first.device), per_row, output_size=num_tiles
    )
    row_offset = per_row.cumsum(0) - per_row
    col = first_col[row] + torch.arange(num_tiles, device=first.device) - row_offset[row]
    q_first, q_last, k_first, k_last = first[row], last[row], first[col], last[col]
    full = allowed(None, None, q_first, k_first) & allowed(None, None, q_first, k_last)
    k_star = torch.maximum(k_first, torch.minimum(k_last, keys.row_limit[q_last] - 1))
    non_empty = allowed(None, None, q_last, k_star)

    # Blocks: full where full tiles cover block_size², partial where any tile is non-empty.
    block = first // block_size
    flat = block[row] * num_blocks + block[col]
    full_area = torch.zeros(num_blocks * num_blocks, dtype=torch.int64, device=first.device)
    full_area.index_add_(0, flat, (q_last - q_first + 1) * (k_last - k_first + 1) * full)
    hits = torch.zeros_like(full_area).index_add_(0, flat, non_empty.to(torch.int64))
    full_blocks = (full_area == block_size * block_size).view(num_blocks, num_blocks)
    partial_blocks = (hits > 0).view(num_blocks, num_blocks) & ~full_blocks

    kv_num_blocks, kv_indices = _ordered(partial_blocks)
    full_kv_num_blocks, full_kv_indices = _ordered(full_blocks)
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=block_size,
        mask_mod=allowed,
        seq_lengths=(layout.length, layout.length),
    )
