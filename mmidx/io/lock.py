"""Locks held with ``flock``: an exclusive lock on an output prefix, so that two builds or merges never write one
dataset at once, and a bounded wait for a lock other processes hold briefly (the node cache's).

The output lock is ``PREFIX.lock``, held with ``flock`` (the kernel releases it when its holder dies, so a
stale lock of a dead process is taken over) and naming its holder's pid and host, so the second
build refuses at once and says who holds it.

:func:`wait_for_flock` waits a bounded time for a lock held by a process that may be stopped (SLURM's ``scontrol
suspend``, Ctrl-Z, a debugger) or by anyone who can open the file (``flock -x``), and then raises
:class:`LockTimeout` naming the holder, as the kernel lists it in ``/proc/locks``, so that the caller goes on
without the lock instead of stalling.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mmidx.errors import MMIDXError
from mmidx.io.files import errors_naming

_held: set[int] = set()  # lock descriptors of this process, closed in forked children (they never hold a lock)


class OutputLockedError(MMIDXError):
    """Another process is writing the same output (a build, a merge, a precache): the message names it."""


class LockTimeout(MMIDXError):
    """A lock was not free within the wait allowed: the message names its file and its holder."""


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


def wait_for_flock(fd: int, operation: int, path: str | os.PathLike, seconds: float) -> None:
    """Take ``flock(fd, operation)`` (``LOCK_EX`` or ``LOCK_SH``), waiting ``seconds`` at most; then
    :class:`LockTimeout` naming ``path`` and who holds it (:func:`flock_holder`). Polled, a few ms apart."""
    deadline, pause = time.monotonic() + seconds, 0.0005
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
        if left <= 0:
            raise LockTimeout(f"{path} is held by {flock_holder(fd)} for more than {seconds:g} s")
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.01)


def flock_holder(fd: int) -> str:
    """Who holds a ``flock`` on the file open as ``fd``: "pid N (its command, and stopped if it is)", as the kernel
    lists it in ``/proc/locks``; "another process" where that cannot be read (not Linux, another pid namespace)."""
    stat = os.fstat(fd)
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "another process"
    holders = []  # (exclusive first, pid), of the locks held on this file (not the waits, "->")
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4].lstrip("-").isdigit() and fields[5] == device:
            holders.append((fields[3] != "WRITE", int(fields[4])))
    pid = min(holders)[1] if holders else 0
    if pid <= 0:
        return "another process"
    try:
        command = Path(f"/proc/{pid}/comm").read_text().strip()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return f"pid {pid}"
    return f"pid {pid} ({command}{', stopped' if state in ('T', 't') else ''})"
