"""Batch buffers: large tensors handed out from a per-process pool of page-aligned, huge-page-advised
allocations, so building a pack does not fault in fresh memory for every batch; and fresh huge-page-advised
tensors for large outputs that are not pooled (dense attention masks).
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
import torch

from mmidx.io.libc import advise_huge_pages

_PAGE = 4096
_HUGE_PAGE = 2 << 20
_FRESH = 32 << 20  # glibc's largest mmap threshold: allocations from this size up are always mapped afresh


class _BufferPool:
    """Float32 buffers for the large batch keys, reused once no batch uses them any more.

    A fresh buffer of tens of MB is mmapped by the allocator, and filling it is dominated by its
    first-touch page faults, the kernel zeroing every page (2.2 ms per 512² image with 4 KiB pages,
    0.6 ms with 2 MiB ones, measured here; ``madvise(MADV_HUGEPAGE)`` asks for the latter). A reused
    buffer is faulted in already. Buffers are numpy arrays handed out as tensors viewing them: every
    tensor, view or array derived from a batch key keeps its buffer referenced (a copy moved to shared
    memory by a DataLoader worker lets it go), so a buffer whose only references are the pool's is
    free. At most ``size`` buffers are kept; when all are in use, a new unpooled one is made.
    """

    def __init__(self, size: int = 4):
        self.size = size
        self.buffers: list[np.ndarray] = []
        self.lock = threading.Lock()

    def take(self, *shape: int) -> torch.Tensor:
        """An uninitialised float32 CPU tensor of ``shape``."""
        count = math.prod(shape)
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
        return torch.from_numpy(buffer[:count]).view(shape)


def _huge_pages(array: np.ndarray) -> np.ndarray:
    """``array`` (not touched yet), with the kernel asked to back it by transparent huge pages where it can."""
    if array.nbytes >= _HUGE_PAGE:
        start = -(-array.ctypes.data // _PAGE) * _PAGE
        end = (array.ctypes.data + array.nbytes) // _PAGE * _PAGE
        advise_huge_pages(start, end - start)
    return array


_BUFFERS = _BufferPool()


def _batch_buffer(*shape: int) -> torch.Tensor:
    """An uninitialised float32 CPU tensor for a large batch key, from the process's pool (``_BufferPool``)."""
    return _BUFFERS.take(*shape)


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype``; from 32 MiB up, in memory of its own (not pooled:
    freed with the tensor) that the kernel is asked to back by transparent huge pages.

    For large outputs written once, such as dense attention masks. glibc maps every allocation over 32 MiB
    (its largest mmap threshold) afresh, and faulting in 4 KiB pages then costs several times filling them;
    2 MiB pages cost a fraction (the dense masks of an edit pack, 270 MB each: 250 ms per pack with torch's
    allocation, 80 ms here, one thread, ``benchmarks/bench_masks.py``). Smaller tensors come from torch's
    allocator, whose heap reuses freed pages.
    """
    count = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if count < _FRESH:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(_huge_pages(np.empty(count, np.uint8))).view(dtype).view(shape)
