"""The accounting of a node's data cache folder (:mod:`mmidx.io.cache_folder`): ``state.json``, changed only under
the folder's ``lock`` (:class:`Accounting`), and its repair from the files.

**Crash safety.** Whoever holds the lock marks the state busy before changing anything and clears the mark
after; a holder that finds the mark (its predecessor was killed mid-change), a state written before the
machine's last boot or one that no holder could have written (:func:`possible_state`) rebuilds the accounting
from the files (:func:`repair`), deleting temporaries; so does the first process of a run that finds fewer bytes
counted than the role arrays list (:func:`least_bytes`).

**Stalls.** The lock is waited for :data:`LOCK_WAIT_S` seconds at most: a holder stopped while it holds it (SLURM's
``scontrol suspend``, Ctrl-Z, a debugger), or anyone who can open the file and ``flock`` it, would otherwise stall
every reader of the node. The wait's end is a :class:`~mmidx.io.lock.LockTimeout` naming the holder; a reader goes
on without the cache (:class:`~mmidx.io.block_cache.BlockCache`). The lock files are their owner's alone (0600),
or their group's too (0660) in a group-writable folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from mmidx.io.cache_folder import (
    FOLDER_PAGES,
    FORMAT,
    HEADER,
    PAGE,
    ROLE,
    SHA,
    accounted,
    block_bytes,
    block_count,
    entry_bytes,
    folder_bytes,
    new_run,
    role_bytes,
    roles,
)
from mmidx.io.lock import LockTimeout, wait_for_flock


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def repair(data: Path, block_size: int, run: dict[str, Any] | None) -> dict[str, Any]:
    """The state of the cache folder ``data`` rebuilt from its files (under the lock): temporaries deleted, each
    role's arrays rebuilt from the entries found (malformed ones and a role's files without its JSON deleted:
    mmidx's own names, nothing else), the bytes used counted."""
    (data / "tmp").mkdir(exist_ok=True)
    for leftover in (data / "tmp").iterdir():  # the folder stays: a process opening the cache checks it meanwhile
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
    complete = {(sha, role): meta for sha, role, meta in roles(data)}
    for folder in data.glob("*"):
        if not SHA.fullmatch(folder.name) or not folder.is_dir():
            continue
        for path in folder.iterdir():
            stem, _, suffix = path.name.partition(".")
            if not ROLE.fullmatch(stem) or (folder.name, stem) in complete or suffix not in ("", "present", "used"):
                continue
            if path.is_dir():  # a role whose creation was cut short
                shutil.rmtree(path)
            else:
                path.unlink()
    for (sha, role), meta in complete.items():
        count = block_count(meta["bytes"], block_size)
        entries, present = data / sha / role, np.zeros(count, dtype=np.uint64)
        entries.mkdir(exist_ok=True)
        for entry in entries.iterdir():
            block = int(entry.name) if entry.name.isdigit() else -1
            expected = HEADER + int(block_bytes(meta["bytes"], block_size, [block])[0]) if 0 <= block < count else -1
            stat = entry.stat()
            if stat.st_size != expected:
                entry.unlink()  # a name or size no block has: a torn write
            else:
                present[block] = max(stat.st_mtime_ns, 1)
        for suffix, values in (("present", present), ("used", None)):
            path = data / sha / f"{role}.{suffix}"
            if values is None and path.exists() and path.stat().st_size == 8 * count:
                continue
            fresh = data / "tmp" / path.name  # a new file, renamed: a process mapping the old one sees it changed
            fresh.write_bytes((values if values is not None else np.zeros(count, np.uint64)).tobytes())
            os.replace(fresh, path)
    state = data / "state.json"  # about to be written, in one page
    written = accounted(state.stat().st_size) if state.exists() else 0
    return {"format": FORMAT, "bytes": folder_bytes(data) - written + PAGE, "busy": 0, "boot": boot_id(),
            "run": run or new_run()}


def least_bytes(data: Path, block_size: int) -> int:
    """What the folder's files count for at least, by its role arrays: its own files, each dataset's folder, each
    role's files and the entries its ``present`` array lists (arrays of the wrong size aside)."""
    total, datasets = FOLDER_PAGES * PAGE, set()
    for sha, role, meta in roles(data):
        try:
            present = np.fromfile(data / sha / f"{role}.present", dtype=np.uint64)
        except OSError:
            continue
        if len(present) == block_count(meta["bytes"], block_size):
            datasets.add(sha)
            total += role_bytes(meta["bytes"], block_size) + \
                int(entry_bytes(meta["bytes"], block_size, np.flatnonzero(present)).sum())
    return total + len(datasets) * PAGE


LOCK_WAIT_S = 30.0  # the longest wait for the folder's lock (a holder normally keeps it for milliseconds)


def lock_file(path: Path) -> int:
    """Open (made if need be) one of the folder's flock'd files, readable by its owner only (0600), or by its group
    too (0660) when the folder is group-writable (a cache the users of a group share): anyone who can open a lock
    file can hold it, and stall every reader of the node."""
    mode = 0o660 if path.parent.stat().st_mode & 0o020 else 0o600
    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    stat = os.fstat(fd)
    if stat.st_uid == os.geteuid() and stat.st_mode & 0o777 != mode:  # made by an older mmidx (0644), or the umask
        os.fchmod(fd, mode)
    return fd


class Accounting:
    """The lock and ``state.json`` of a cache folder, for one process: :meth:`hold` is the only way to change
    what the cache holds."""

    def __init__(self, data: Path, block_size: int, wait: float | None = None):
        self.data, self.block_size = data, block_size
        self.wait = LOCK_WAIT_S if wait is None else wait
        self._fd = lock_file(data / "lock")
        self._threads = threading.Lock()

    @contextmanager
    def hold(self) -> Iterator[dict[str, Any]]:
        """The state, under the lock, marked busy until the block ends (an exception leaves it busy, for the
        next holder to repair); saved when the block ends. :class:`~mmidx.io.lock.LockTimeout` when the lock is
        not free within ``wait`` seconds (a holder stopped, or another user's ``flock``)."""
        if not self._threads.acquire(timeout=2 * self.wait):  # that thread's wait, and its hold
            raise LockTimeout(f"{self.data / 'lock'} is held by another thread of this process for more than "
                              f"{2 * self.wait:g} s")
        try:
            wait_for_flock(self._fd, fcntl.LOCK_EX, self.data / "lock", self.wait)
            try:
                state = self._load()
                if state is None or state.get("busy") or state.get("boot") != boot_id():
                    state = repair(self.data, self.block_size, (state or {}).get("run"))
                state["busy"] = 1
                self._save(state)
                yield state
                state["busy"] = 0
                self._save(state)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()

    def close(self) -> None:
        os.close(self._fd)

    def _load(self) -> dict[str, Any] | None:
        """The state saved, or None where it is missing or holds what no state can (then it is rebuilt)."""
        try:
            state = json.loads((self.data / "state.json").read_text())
        except (OSError, ValueError):
            return None
        return state if possible_state(state) else None

    def _save(self, state: dict[str, Any]) -> None:
        """Write the state in place (no temporary: the folder never holds a page more than counted); a kill
        between the write and the truncation leaves a tail that fails to parse, which the next holder repairs."""
        raw = json.dumps(state).encode()
        fd = os.open(self.data / "state.json", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, raw, 0)
            os.ftruncate(fd, len(raw))
        finally:
            os.close(fd)


def possible_state(state: Any) -> bool:
    """Whether ``state`` could be what a holder saved: the format, a count of bytes no smaller than the folder's own
    files, counters that are counts. A state edited by hand (negative bytes, say) would let the folder grow past
    its limit, so it is not trusted: the folder is counted again."""
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("busy") not in (0, 1):
        return False
    run, limit = state.get("run"), state.get("limit", 0)
    return _count(state.get("bytes")) and state["bytes"] >= FOLDER_PAGES * PAGE and isinstance(run, dict) and \
        all(_count(value) for name, value in run.items() if name != "started") and (limit is None or _count(limit))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
