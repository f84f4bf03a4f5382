"""What ``mmidx cache`` reads and removes in a cache folder (:mod:`mmidx.io.cache_folder`): ``info`` (the data
cache's size, datasets and last run) and ``clear`` (all of mmidx's cached files, or one dataset's).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from mmidx.io.cache_accounting import Accounting, lock_file
from mmidx.io.cache_folder import (
    SHA,
    CacheError,
    entry_bytes,
    folder_bytes,
    read_block_size,
    read_state,
    roles,
)


def same_dataset(recorded: str, asked: str) -> bool:
    """Whether two dataset URIs name the same prefix (query options and a trailing slash aside)."""
    return recorded.partition("?")[0].rstrip("/") == asked.partition("?")[0].rstrip("/")


def existing_folder(folder: str | os.PathLike) -> Path:
    """``folder`` as a path, or a :class:`CacheError` when it is no folder: a cache that does not exist holds
    nothing, which "0 B" would not say (a mistyped folder reads as an empty cache)."""
    folder = Path(folder)
    if not folder.is_dir():
        why = "not a folder" if folder.exists() else "no such folder"
        raise CacheError(f"{folder}: {why}: give mmidx's cache folder (as --cache-dir; by default $MMIDX_CACHE_DIR, "
                         "else ~/.cache/mmidx, made by the first read of a remote dataset)")
    return folder


def cache_info(folder: str | os.PathLike) -> dict[str, Any]:
    """What ``mmidx cache info`` prints: the data cache's size (counted on disk), its block size, the limit the
    last run kept it under, each dataset's blocks and bytes, and the last run's counters. A ``folder`` that does
    not exist is a :class:`CacheError`."""
    data = existing_folder(folder) / "data"
    state = read_state(data)
    block_size = read_block_size(data)
    datasets: dict[str, dict[str, int]] = {}
    for sha, role, meta in roles(data):
        try:
            present = np.fromfile(data / sha / f"{role}.present", dtype=np.uint64)
        except OSError:
            continue
        stored = np.flatnonzero(present)
        entry = datasets.setdefault(meta["dataset"], {"versions": 0, "blocks": 0, "bytes": 0})
        entry["blocks"] += len(stored)
        if block_size:
            entry["bytes"] += int(entry_bytes(meta["bytes"], block_size, stored).sum())
    for versions in {(meta["dataset"], sha) for sha, _, meta in roles(data)}:
        datasets[versions[0]]["versions"] += 1
    return {"folder": str(data), "bytes": folder_bytes(data), "block_size": block_size, "limit": state.get("limit"),
            "datasets": datasets, "run": state.get("run", {}), "small_files": folder_bytes(Path(folder) / "remote")}


def clear_cache(folder: str | os.PathLike, dataset: str | None = None) -> int:
    """Delete the data blocks (all, or ``dataset``'s: every version of that URI) and the remote datasets' small
    files (theirs) from mmidx's cache folder ``folder``; the bytes freed. Only mmidx's own files are deleted (in
    ``data/``: the entries, their arrays and JSONs, and, when no process has the cache open, the folder's own
    files; in ``remote/``: the folders named by a metadata checksum); anything else is left as it is. Running
    readers see a miss and fetch again. A ``folder`` that does not exist is a :class:`CacheError`."""
    folder = existing_folder(folder)
    data, remote = folder / "data", folder / "remote"
    before = folder_bytes(data) + folder_bytes(remote)
    shas = {sha for sha, _, meta in roles(data) if dataset is None or same_dataset(meta["dataset"], dataset)}
    small = [path for path in remote.glob("*") if SHA.fullmatch(path.name) and path.is_dir() and (
        dataset is None or path.name in shas or _small_files_of(path, dataset))]
    block_size = read_block_size(data)
    if block_size is not None:
        accounting = Accounting(data, block_size)
        with contextlib.closing(accounting), accounting.hold() as state:
            for path in data.glob("*"):
                if SHA.fullmatch(path.name) and (dataset is None or path.name in shas):
                    shutil.rmtree(path, ignore_errors=True)
            state["bytes"] = folder_bytes(data)
    if dataset is None and data.is_dir():
        _remove_idle(data)
    for path in small:
        shutil.rmtree(path, ignore_errors=True)
    if dataset is None:
        shutil.rmtree(remote / "incoming", ignore_errors=True)
        with contextlib.suppress(OSError):  # unless something that is not the cache's is left there
            remote.rmdir()
    return before - folder_bytes(data) - folder_bytes(remote)


def _remove_idle(data: Path) -> None:
    """Remove the cache folder's own files when no process has the cache open (its ``users`` lock is free)."""
    fd = lock_file(data / "users")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return
    try:
        shutil.rmtree(data / "tmp", ignore_errors=True)
        for name in ("cache.json", "state.json", "lock", "users"):
            (data / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # unless something that is not the cache's is left there
            data.rmdir()
    finally:
        os.close(fd)


def _small_files_of(path: Path, dataset: str) -> bool:
    try:
        return same_dataset((path / "uri").read_text(), dataset)
    except OSError:
        return False
