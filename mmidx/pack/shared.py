"""Batches built in DataLoader workers, handed to the trainer process without a copy.

torch's DataLoader pickles each batch a worker returns (``ForkingPickler``), and torch's reduction of a tensor whose
memory is not shared moves it into a fresh shared-memory file: the kernel allocates and zeroes every page of the
file, the worker faults each one in and copies the bytes there, and each file's descriptor is fetched by the
trainer process over a socket, one per tensor. For a pack of 512² images that was a third to a half of a worker's
CPU (docs/benchmarks.md, Accelerator utilisation).

Here a worker builds its packs' tensors in *segments* instead: files in memory (``memfd_create``) that it maps
once and reuses pack after pack, so their pages are faulted in once per worker, not once per pack. A pack's
tensors lie one after the other in one segment (the large keys are written there in place, the small ones copied
in when the pack is complete: :meth:`SegmentPool.adopt`). Its reduction (``mmidx.pack.batch``'s, registered with
``ForkingPickler``, so plain pickling is untouched) sends the segment's descriptor and each tensor's place in it,
and the process that receives it maps the same pages (:func:`attach`): nothing is copied. Tensors in no segment (a
batch built in the trainer process, or re-sent by it) are pickled by torch as before.

A segment is written again only once every process that received it has let go of it. Its first page holds two
counters, each written by one process only: the hand-overs, which the worker adds to when it pickles a batch in
the segment, and the releases, which the receiving process adds to when the array owning its mapping is freed
(a finalizer; every tensor, view or array made from the mapping holds that array). The worker reuses a segment
when no tensor of its own views it and the two counters are equal; a release it reads late only delays the
reuse. A batch pickled but never received keeps its segment out of use for the worker's life (memory held, never
an overwrite); a process forked from the receiver counts no releases.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np
import torch

from mmidx.io.libc import advise_huge_pages

_COUNT = struct.Struct("=Q")  # a counter of a segment's first page; each is written by one process only
_HANDED, _RELEASED = 0, 8  # the counters' offsets: hand-overs (written by the worker), releases (by the receiver)
_HEADER = 4096  # the counters' page: tensors start on the next one
_ALIGN = 64  # each tensor starts on a cache line
CAPACITY = 4 << 30  # bytes a segment can hold: address space only, pages exist where tensors were written
KEEP = 8  # segments a worker keeps: the packs queued for the trainer, held by it, and the one being built


@dataclass(frozen=True)
class Place:
    """Where a tensor lies in the segments of a hand-over: segment number, byte offset, dtype, shape."""

    segment: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def tensor(self, arrays: list[np.ndarray]) -> torch.Tensor:
        """The tensor, viewing segment ``self.segment``'s mapping (``arrays``, from :func:`attach`)."""
        return _viewed(arrays[self.segment][self.offset:self.end], self.dtype, self.shape)

    @property
    def end(self) -> int:
        return self.offset + int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _viewed(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes ``data`` as a tensor of ``dtype`` and ``shape``, holding the array (and so the mapping)."""
    return torch.from_numpy(data).view(dtype).view(shape)


class _Segment:
    """One memfd of ``capacity`` bytes, mapped in the worker; ``array`` owns the mapping, ``used`` is the end of its
    tensors so far."""

    def __init__(self, capacity: int):
        self.fd = os.memfd_create("mmidx-batch", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity)
        self.map = mmap.mmap(self.fd, capacity)
        self.array = np.frombuffer(self.map, np.uint8)
        self.address = self.array.ctypes.data
        self.used = _HEADER
        advise_huge_pages(self.address + _HEADER, capacity - _HEADER)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.address + _HEADER <= tensor.data_ptr() < self.address + self.array.size

    def free(self) -> bool:
        """No tensor of this process views it (the array is referenced by this segment and the call only), then
        every hand-over of it released (read after: a batch drops its views once it has been handed over)."""
        if sys.getrefcount(self.array) > 2:
            return False
        return _COUNT.unpack_from(self.map, _HANDED) == _COUNT.unpack_from(self.map, _RELEASED)

    def close(self) -> None:
        del self.array
        self.map.close()
        os.close(self.fd)


class SegmentPool:
    """The segments of one worker process; the pack being built takes its memory from the open one."""

    def __init__(self, capacity: int = CAPACITY, keep: int = KEEP):
        self.capacity, self.keep = capacity, keep
        self.segments: list[_Segment] = []
        self.open: _Segment | None = None
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` uninitialised bytes for the pack being built, in the open segment (a free one is opened when
        there is none, or when it is full); None when the system refuses a new segment (out of descriptors or
        address space): the caller uses private memory, which torch copies when it hands the batch over."""
        with self.lock:
            if self.open is not None and self.open.free():  # what was built in it is gone (a pack that failed)
                self.open.used = _HEADER
            start = _HEADER if self.open is None else -(-self.open.used // _ALIGN) * _ALIGN
            if self.open is None or start + nbytes > self.open.array.size:
                try:
                    self.open = self._free_segment(nbytes)
                except OSError:
                    self.open = None
                    return None
                start = _HEADER
            self.open.used = start + nbytes
            return self.open.array[start:start + nbytes]

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` for the pack being built, in shared memory where :meth:`take`
        gives it."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        data = self.take(nbytes) if nbytes else None
        return torch.empty(shape, dtype=dtype) if data is None else _viewed(data, dtype, shape)

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself if it lies in a segment (or is empty, or no segment can be had), else a copy of it in
        the open segment."""
        if tensor.numel() == 0 or self.place_of(tensor, []) is not None:
            return tensor
        data = self.take(tensor.numel() * tensor.element_size())
        return tensor if data is None else _viewed(data, tensor.dtype, tuple(tensor.shape)).copy_(tensor)

    def seal(self) -> None:
        """The pack being built is complete: the next one takes another segment, so that each can be reused as
        soon as its own pack is released."""
        with self.lock:
            self.open = None

    def _free_segment(self, nbytes: int) -> _Segment:
        """A free segment, emptied, that holds ``nbytes``; a new one when none does. Free segments beyond ``keep``
        are closed."""
        found = None
        for segment in list(self.segments):
            if segment.free():
                if found is None and segment.array.size >= _HEADER + nbytes:
                    found = segment
                elif len(self.segments) > self.keep:
                    self.segments.remove(segment)
                    segment.close()
        if found is None:
            found = _Segment(max(self.capacity, -(-(_HEADER + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE))
            self.segments.append(found)
        found.used = _HEADER
        return found

    def place_of(self, tensor: torch.Tensor, handed: list[_Segment]) -> Place | None:
        """Where ``tensor`` lies, as a :class:`Place` numbering segments by their order in ``handed`` (a segment
        not there yet is appended); None when it lies in none (or is not one contiguous block)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            return None
        with self.lock:  # the queue's thread pickles while the worker's main thread builds the next pack
            segments = list(self.segments)
        for segment in segments:
            if segment.holds(tensor):
                if segment not in handed:
                    handed.append(segment)
                return Place(handed.index(segment), tensor.data_ptr() - segment.address, tensor.dtype,
                             tuple(tensor.shape))
        return None

    def hand_over(self, handed: list[_Segment], places: list[Place]) -> list[tuple[Any, int]]:
        """Count a hand-over of each of ``handed`` and return their handles for :func:`attach`: a descriptor
        (sent over the worker's resource sharer, as torch sends its own) and the bytes to map, up to the end of
        the last of ``places`` in it."""
        handles = []
        with self.lock:
            for number, segment in enumerate(handed):
                end = max(place.end for place in places if place.segment == number)
                _COUNT.pack_into(segment.map, _HANDED, _COUNT.unpack_from(segment.map, _HANDED)[0] + 1)
                handles.append((DupFd(segment.fd), end))
        return handles


_POOL: tuple[int, SegmentPool] | None = None  # (the process it belongs to, the pool): a forked child starts anew


def worker_pool() -> SegmentPool | None:
    """This process's segment pool when it is a DataLoader worker on a system with ``memfd_create``; else None
    (the trainer process, where nothing is handed over)."""
    global _POOL
    if not hasattr(os, "memfd_create") or torch.utils.data.get_worker_info() is None:
        return None
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = os.getpid(), SegmentPool()
    return _POOL[1]


_RELEASES = threading.Lock()


def _release(mapping: mmap.mmap, pid: int) -> None:
    """A mapping's finalizer: one more release of its segment, counted by the process that received it."""
    if os.getpid() != pid:
        return
    with _RELEASES:
        _COUNT.pack_into(mapping, _RELEASED, _COUNT.unpack_from(mapping, _RELEASED)[0] + 1)


def attach(handles: list[tuple[Any, int]]) -> list[np.ndarray]:
    """The segments of a hand-over, mapped in this process: one array owning each mapping, which counts a release
    when it is freed (after every tensor made from it)."""
    arrays = []
    for handle, length in handles:
        fd = handle.detach()
        try:
            mapping = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        array = np.frombuffer(mapping, np.uint8)
        weakref.finalize(array, _release, mapping, os.getpid()).atexit = False
        arrays.append(array)
    return arrays
