"""On-disk cache of index arrays, built once per job.

A cache entry is a folder named by a hash of everything the arrays depend on, holding one raw
``<name>.bin`` file per array and an ``index.json`` with the description in full, each array's
dtype and shape, and the build's stats. Arrays are written a chunk at a time as they are produced
(:class:`ArraySink`), so a build never holds them whole. The entry is written under a temporary
folder name, ``index.json`` last, then renamed: a killed build leaves only a ``.partial-*`` folder,
which nothing loads. Entries are opened in O(1) (each array memory-mapped, its size checked
against ``index.json``). Under ``torch.distributed`` rank 0 builds and every other rank waits on a
barrier, then maps the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mmidx.format import FormatError

Arrays = dict[str, np.ndarray]
# Raw .bin arrays described by index.json; part of every key, so other layouts never collide.
CACHE_LAYOUT = 2
INDEX_FILE = "index.json"


def available_memory() -> int:
    """Bytes of memory this machine can give a process without swapping (Linux's ``MemAvailable``; elsewhere
    the physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as stream:
            for line in stream:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def description_key(description: dict[str, Any]) -> str:
    """The folder name of a cache entry: a hash of its JSON description (and the cache layout)."""
    keyed = json.dumps({"description": description, "layout": CACHE_LAYOUT}, sort_keys=True, default=str)
    return hashlib.sha256(keyed.encode()).hexdigest()[:24]


class ArraySink:
    """Named 1-D or 2-D arrays appended a chunk at a time: to raw files in ``folder``, or, without
    one, kept in memory. Each array's dtype is fixed when it is declared; chunks are cast to it."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.dtypes: dict[str, np.dtype] = {}
        self.shapes: dict[str, list[int]] = {}
        self._files: dict[str, Any] = {}
        self._chunks: dict[str, list[np.ndarray]] = {}

    def declare(self, name: str, dtype: np.dtype | type, row_shape: tuple[int, ...] = ()) -> None:
        """Start array ``name`` of ``dtype`` (rows of ``row_shape``), empty."""
        self.dtypes[name] = np.dtype(dtype)
        self.shapes[name] = [0, *row_shape]
        if self.folder is None:
            self._chunks[name] = []
        else:
            self._files[name] = open(self.folder / f"{name}.bin", "wb")  # closed by finish()

    def append(self, name: str, chunk: np.ndarray) -> None:
        """Append rows; values must fit the declared dtype (the caller chose it to)."""
        chunk = np.ascontiguousarray(chunk, dtype=self.dtypes[name])
        if list(chunk.shape[1:]) != self.shapes[name][1:]:
            raise ValueError(f"{name}: rows of shape {chunk.shape[1:]}, declared {tuple(self.shapes[name][1:])}")
        self.shapes[name][0] += len(chunk)
        if self.folder is None:
            self._chunks[name].append(chunk)
        else:
            self._files[name].write(chunk.data)

    def finish(self) -> Arrays | None:
        """Close the files (return None), or return the in-memory arrays (each chunk let go of as it is copied into
        its array, so that the arrays are held once, not twice)."""
        for stream in self._files.values():
            stream.close()
        if self.folder is not None:
            return None
        arrays = {}
        for name, chunks in self._chunks.items():
            array, filled = np.empty(self.shapes[name], self.dtypes[name]), 0
            chunks.reverse()
            while chunks:
                chunk = chunks.pop()
                array[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
            arrays[name] = array
        return arrays

    def require_room(self, nbytes: int, what: str, advice: str) -> None:
        """Refuse, before any work, arrays of about ``nbytes`` that cannot fit where this sink writes them: the
        memory this machine has available (no folder; the arrays are joined at the end, so twice theirs), or the
        free space of the folder's disk. The message names ``what`` asked for them, then the ``advice``."""
        if self.folder is None:
            needed, room, where = 2 * nbytes, available_memory(), "memory this machine has available"
        else:
            needed, room = nbytes, shutil.disk_usage(self.folder).free
            where = f"free on the disk of {self.folder.parent}"
        if needed > room:
            raise ValueError(f"{what} would need about {needed / 1e9:,.1f} GB, more than the {room / 1e9:,.1f} GB "
                             f"{where}: {advice}")

    def layout(self) -> dict[str, dict[str, Any]]:
        return {name: {"dtype": self.dtypes[name].str, "shape": self.shapes[name]} for name in self.dtypes}


def _distributed() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def cached_build(cache_dir: str | os.PathLike | None, description: dict[str, Any],
                 build: Callable[[ArraySink], dict[str, Any]]) -> tuple[Arrays, dict[str, Any], Path | None, bool]:
    """(arrays, stats, entry folder or None, reused): ``build(sink)`` writes the arrays into the sink
    and returns the stats; from ``cache_dir`` when an entry for ``description`` is there already.

    Without a cache dir every process builds for itself, in memory.
    """
    if cache_dir is None:
        sink = ArraySink(None)
        stats = build(sink)
        return sink.finish(), stats, None, False
    folder = Path(cache_dir) / description_key(description)
    dist = _distributed()
    reused = folder.exists()
    if (dist is None or dist.get_rank() == 0) and not reused:
        _build_entry(folder, description, build)
    if dist is not None:
        dist.barrier()
    arrays, stats = open_entry(folder)
    return arrays, stats, folder, reused


def cached_arrays(cache_dir: str | os.PathLike | None, description: dict[str, Any],
                  build: Callable[[], tuple[Arrays, dict[str, Any]]]) -> tuple[Arrays, dict[str, Any], Path | None]:
    """``build()``'s whole (arrays, stats), from ``cache_dir`` when an entry for ``description`` exists.

    Without a cache dir every process builds for itself. Returns the entry's folder too (or None).
    """
    if cache_dir is None:
        arrays, stats = build()
        return arrays, stats, None

    def write(sink: ArraySink) -> dict[str, Any]:
        arrays, stats = build()
        for name, array in arrays.items():
            sink.declare(name, array.dtype, array.shape[1:])
            sink.append(name, array)
        return stats

    arrays, stats, folder, _ = cached_build(cache_dir, description, write)
    return arrays, stats, folder


def _build_entry(folder: Path, description: dict[str, Any], build: Callable[[ArraySink], dict[str, Any]]) -> None:
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    sink = ArraySink(partial)
    try:
        stats = build(sink)
    except BaseException:
        sink.finish()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    sink.finish()
    index = {"description": description, "arrays": sink.layout(), "stats": stats}
    (partial / f"{INDEX_FILE}.tmp").write_text(json.dumps(index, indent=1, sort_keys=True, default=str))
    (partial / f"{INDEX_FILE}.tmp").rename(partial / INDEX_FILE)
    try:
        partial.rename(folder)
    except OSError:  # another process finished the same entry first; theirs is identical
        shutil.rmtree(partial, ignore_errors=True)


def open_entry(folder: Path) -> tuple[Arrays, dict[str, Any]]:
    """(arrays memory-mapped, stats) of a cache entry; a ``FormatError`` if any file is off."""
    path = folder / INDEX_FILE
    try:
        index = json.loads(path.read_text())
        layout, stats = index["arrays"], index["stats"]
        arrays = {}
        for name, spec in layout.items():
            dtype, shape = np.dtype(spec["dtype"]), tuple(int(n) for n in spec["shape"])
            arrays[name] = _map(folder / f"{name}.bin", dtype, shape)
    except (OSError, ValueError, KeyError, TypeError, SyntaxError) as error:  # SyntaxError: a bad dtype string
        if isinstance(error, FormatError):
            raise
        raise FormatError(f"{path}: not a complete cache entry ({error}); delete {folder} to rebuild it") from error
    return arrays, stats


def _map(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if any(n < 0 for n in shape):
        raise FormatError(f"{path}: negative shape {shape} in {INDEX_FILE}; delete the entry to rebuild it")
    expected = int(np.prod(shape, dtype=object)) * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise FormatError(f"{path}: {actual} bytes, {INDEX_FILE} says {shape} of {dtype} ({expected} bytes); "
                          f"delete {path.parent} to rebuild it")
    if expected == 0:
        empty = np.empty(shape, dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)
