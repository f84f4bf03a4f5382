"""Linux system calls mmidx makes through the C library, each a no-op where the call is missing: huge-page
advice for batch buffers (``advise_huge_pages``), early writeback of files being written
(``start_writeback``), and a worker's death with its parent (``die_with_parent``).

The C library is loaded once per process (``_libc``); a call it lacks (not Linux, not glibc) degrades to
doing nothing, since each of these only helps: none is needed for a correct result.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time
from typing import Any

MADV_HUGEPAGE = 14  # from <linux/mman.h>
SYNC_FILE_RANGE_WRITE = 2  # from <linux/fs.h>
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@functools.cache
def _libc_function(name: str, argtypes: tuple[Any, ...]) -> Any | None:
    """The C library's function ``name`` with its argument types, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError, TypeError):  # no POSIX libc, or not this call
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def advise_huge_pages(address: int, length: int) -> None:
    """Ask the kernel to back ``[address, address + length)`` with huge pages (``madvise(MADV_HUGEPAGE)``)."""
    madvise = _libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    if madvise is not None:
        madvise(address, length, MADV_HUGEPAGE)  # advice: a refusal changes nothing but speed


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel begin writing a file range to the disk without waiting
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``); elsewhere nothing, and the final fsync does it all."""
    sync_file_range = _libc_function("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint))
    if sync_file_range is not None:
        # A failure is ignored: this only hurries the disk, the fsync reports errors.
        sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)


def die_with_parent(parent: int) -> None:
    """Make this worker process end when ``parent`` does, even by ``kill -9``.

    On Linux the kernel sends SIGKILL (``prctl(PR_SET_PDEATHSIG)``); elsewhere a thread watches the parent.
    Either way the request only covers a parent that is still alive when it is made, so the worker then
    checks that its parent is still ``parent`` (the process that started it) and ends at once otherwise.
    """
    prctl = _libc_function("prctl", (ctypes.c_int, ctypes.c_ulong))
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)
