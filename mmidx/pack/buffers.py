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
    """An uninitialised CPU tensor of ``shape`` and ``dtype`` in memory of its own (not pooled: freed with the
    tensor), with the kernel asked to back it by transparent huge pages.

    For large outputs written once, such as dense attention masks: faulting in fresh 4 KiB pages costs
    several times filling them (a 7000² float32 mask: 105 ms allocated and filled by torch, 19 ms here,
    15 ms to fill reused memory; measured on this machine, one thread), 2 MiB pages a fraction of it.
    """
    count = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if count < _HUGE_PAGE:  # less than one huge page: the allocator's memory as it is
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(_huge_pages(np.empty(count, np.uint8))).view(dtype).view(shape)
