"""Batch buffers: large tensors handed out from per-process pools of page-aligned, huge-page-advised
allocations, so building a pack does not fault in fresh memory for every batch: one pool for the large batch
keys (pixels, precached encodings), one for the dense attention masks built on the CPU. In a DataLoader worker
the batch keys come from shared memory instead (:mod:`mmidx.pack.shared`), so handing the batch over copies
nothing.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
import torch

from mmidx.io.libc import advise_huge_pages
from mmidx.pack import shared

_PAGE = 4096
_HUGE_PAGE = 2 << 20
_FRESH = 32 << 20  # glibc's largest mmap threshold: allocations from this size up are always mapped afresh


class _BufferPool:
    """Float32 buffers for the large batch keys, reused once no batch uses them any more.

    A fresh buffer of tens of MB is mmapped by the allocator, and filling it is dominated by its
    first-touch page faults, the kernel zeroing every page (2.2 ms per 512² image with 4 KiB pages,
    0.6 ms with 2 MiB ones, measured here; ``madvise(MADV_HUGEPAGE)`` asks for the latter). A reused
    buffer is faulted in already. Buffers are numpy arrays handed out as tensors viewing them: every
    tensor, view or array derived from a batch key keeps its buffer referenced (a copy that torch moves to
    shared memory lets it go), so a buffer whose only references are the pool's is free. At most ``size``
    buffers are kept; when all are in use, a new unpooled one is made.
    """

    def __init__(self, size: int = 4):
        self.size = size
        self.buffers: list[np.ndarray] = []
        self.lock = threading.Lock()

    def take(self, *shape: int) -> torch.Tensor:
        """An uninitialised float32 CPU tensor of ``shape``."""
        count = math.prod(shape)
        return torch.from_numpy(self.buffer(count)[:count]).view(shape)

    def buffer(self, count: int) -> np.ndarray:
        """A whole pooled float32 array of at least ``count`` values that nothing else uses: the caller hands out
        views of it, and it is free again once none of them (nor anything derived from them) is alive."""
        with self.lock:
            # Unused: referenced only by the pool's list and by getrefcount's own argument.
            free = [i for i in range(len(self.buffers)) if sys.getrefcount(self.buffers[i]) == 2]
            fitting = [i for i in free if self.buffers[i].size >= count]
            if fitting:
                buffer = self.buffers[fitting[0]]
            else:
                buffer = _huge_pages(np.empty(count, np.float32))
                if free:
                    self.buffers[free[0]] = buffer  # replace a free buffer that is too small
                elif len(self.buffers) < self.size:
                    self.buffers.append(buffer)
        return buffer


def _huge_pages(array: np.ndarray) -> np.ndarray:
    """``array`` (not touched yet), with the kernel asked to back it by transparent huge pages where it can."""
    if array.nbytes >= _HUGE_PAGE:
        start = -(-array.ctypes.data // _PAGE) * _PAGE
        end = (array.ctypes.data + array.nbytes) // _PAGE * _PAGE
        advise_huge_pages(start, end - start)
    return array


_BUFFERS = _BufferPool()


def _batch_buffer(*shape: int) -> torch.Tensor:
    """An uninitialised float32 CPU tensor for a large batch key: in a DataLoader worker, in the shared memory of
    the pack being built (:class:`mmidx.pack.shared.SegmentPool`), else from the process's pool
    (``_BufferPool``)."""
    pool = shared.worker_pool()
    if pool is not None:
        return pool.tensor(shape, torch.float32)
    return _BUFFERS.take(*shape)


_MASK_BUFFERS = _BufferPool(size=2)  # the masks of the batch in use and of the one being built


def mask_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` uninitialised bytes for the dense masks of one pack on the CPU; from 32 MiB
    up, from a pool of two buffers that are reused once no mask of theirs is alive (``_BufferPool``).

    A pack's dense masks are hundreds of MB written once, and in fresh memory most of their cost is the kernel
    faulting in and zeroing every page, then unmapping it when the masks are freed; in a reused buffer only
    the stores are left (``benchmarks/bench_masks.py`` times both: docs/benchmarks.md, Masks). A process
    building dense masks on the CPU thus keeps the memory of its two largest packs' masks. Smaller requests
    come from the heap, whose freed pages are reused. Views of the array (each mask a ``torch.from_numpy`` of
    its own slice) keep it in use.
    """
    if nbytes < _FRESH:
        return np.empty(nbytes, np.uint8)
    return _MASK_BUFFERS.buffer(-(-nbytes // 4)).view(np.uint8)[:nbytes]
