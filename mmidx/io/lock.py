"""An exclusive lock on an output prefix, so that two builds or merges never write one dataset at once.

The lock is ``PREFIX.lock``, held with ``flock`` (the kernel releases it when its holder dies, so a
stale lock of a dead process is taken over) and naming its holder's pid and host, so the second
build refuses at once and says who holds it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from mmidx.errors import MMIDXError
from mmidx.io.files import errors_naming

_held: set[int] = set()  # lock descriptors of this process, closed in forked children (they never hold a lock)


class OutputLockedError(MMIDXError):
    """Another process is writing the same output (a build, a merge, a precache): the message names it."""


def _close_in_child() -> None:
    for fd in _held:
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


@contextmanager
def output_lock(prefix: str | os.PathLike, what: str = "build") -> Iterator[None]:
    """Hold ``PREFIX.lock`` while the block runs; raise OutputLockedError at once if another process holds it."""
    path = os.fspath(prefix) + ".lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputLockedError(f"{prefix} is being written by another {holder.get('what', 'build')} (pid "
                             f"{holder.get('pid', '?')} on host {holder.get('host', '?')}; lock {path}); "
                             "wait for it to end") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file between our open and flock: lock the new one
    _held.add(fd)
    try:
        with errors_naming(path):
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": what}).encode())
        yield
    finally:
        _held.discard(fd)
        os.unlink(path)
        os.close(fd)


def _holder(fd: int) -> dict[str, object]:
    try:
        loaded = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}
