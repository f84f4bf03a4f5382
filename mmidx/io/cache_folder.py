"""The folder of a node's remote-data cache: its settings and its layout.

**Settings.** ``cache_dir`` (``--cache-dir``, ``$MMIDX_CACHE_DIR``, default ``~/.cache/mmidx``) is mmidx's cache
folder: remote datasets' small files live in ``DIR/remote/``, the data blocks in ``DIR/data/``. The data cache is
on when a limit is given (``cache_limit``, ``--cache-limit``, ``$MMIDX_CACHE_LIMIT``; 0 turns it off): a cache
that may fill a node's disk is worse than none, so there is no default limit. ``cache_offline``
(``--cache-offline``, ``$MMIDX_CACHE_OFFLINE=1``) opens remote datasets from the cache alone.

**Layout of** ``DIR/data``::

    cache.json              {"format": 1, "block_size": B}, written once: every entry is one block of B bytes
    state.json              the accounting: bytes used, the last run's counters (changed under the lock)
    lock, users             flock'd (0600; 0660 in a group-writable folder): ``lock`` while the accounting
                            changes; ``users`` shared by every process with the cache open (an exclusive try
                            that succeeds starts a new run); neither waited for longer than LOCK_WAIT_S
    tmp/                    entries being written (only under the lock: one found there is a dead writer's)
    SHA/ROLE.json           what the file is: the dataset's URI, the object's, its size
    SHA/ROLE.present        uint64 a block: when it was stored, 0 when absent (changed under the lock)
    SHA/ROLE.used           uint64 a block: when it was last read (a hint readers write without the lock)
    SHA/ROLE/BLOCK          an entry: MAGIC, the xxh3-64 of the key and the bytes, then the block's bytes

``SHA`` is the ``meta_sha256`` of the JSON describing the file (the dataset's metadata, or a precached
encoding's), so a changed dataset never serves stale bytes. Sizes are counted as a filesystem stores them:
each file in whole 4 KiB pages, each folder one page (:func:`folder_bytes`); the limit bounds that sum.

The accounting (``state.json`` under ``lock``) and its repair are :mod:`mmidx.io.cache_accounting`'s; ``mmidx
cache info`` and ``clear`` are :mod:`mmidx.io.cache_admin`'s.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmidx.errors import MMIDXError

CACHE_DIR_VARIABLE, CACHE_LIMIT_VARIABLE, CACHE_OFFLINE_VARIABLE = "MMIDX_CACHE_DIR", "MMIDX_CACHE_LIMIT", \
    "MMIDX_CACHE_OFFLINE"
BLOCK_SIZE = 1 << 20  # the default block (see docs/guide/storage.md: why a fixed block, why this size)
PAGE = 4096
FORMAT = 1
MAGIC = b"MMIDXBK1"
HEADER = len(MAGIC) + 8  # the magic, then the digest
MIN_BLOCKS = 4  # a limit must hold this many blocks of a file, with the folder's own files (smallest_limit)
FOLDER_PAGES = 4  # what the folder counts for holding no block: data/ itself, cache.json, state.json and tmp/
SHA = re.compile(r"[0-9a-f]{64}")
ROLE = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


class CacheError(MMIDXError):
    """The data cache cannot be used as configured (a folder it cannot write, a limit too small to hold blocks)."""


def parse_size(text: str | int) -> int:
    """Bytes from ``text``: an integer, or a number with a unit (``500G``, ``1.5T``, ``64MiB``; K, M, G, T are
    powers of 1000, KiB... of 1024; a trailing B is optional)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]?I?)B?\s*", str(text).upper())
        if match is None or (match[2] == "I"):
            raise CacheError(f"{text!r} is not a size in bytes (e.g. 500000000000, 500G, 1.5T, 64MiB)")
        value = int(float(match[1]) * _UNITS[match[2]])
        if value == 0 and float(match[1]) != 0:  # 0.5 would turn the data cache off
            raise CacheError(f"{text!r} is less than one byte: give a size in bytes (e.g. 500G, 1.5T, 64MiB), or 0 to "
                             "turn the data cache off")
    if value < 0:
        raise CacheError(f"{text!r}: a cache limit is not negative (0 turns the data cache off)")
    return value


@dataclass(frozen=True)
class CacheSettings:
    """Where a reader caches: ``folder`` (small files in ``folder/remote``, data blocks in ``folder/data``),
    ``limit``, the bytes the data blocks may take (None: data is read uncached), and ``offline``: a remote dataset
    is opened and read from the cache alone, the store never asked (:mod:`mmidx.io.small_files`)."""

    folder: Path
    limit: int | None = None
    offline: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "folder", Path(self.folder))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled into every worker with its dataset: a string, not a Path
        return CacheSettings, (os.fspath(self.folder), self.limit, self.offline)

    @property
    def data(self) -> Path:
        """The data cache's own folder."""
        return self.folder / "data"


def default_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """mmidx's cache folder: ``cache_dir``, else ``$MMIDX_CACHE_DIR``, else ``~/.cache/mmidx``."""
    return Path(cache_dir or os.environ.get(CACHE_DIR_VARIABLE) or Path.home() / ".cache" / "mmidx")


def cache_settings(cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                   cache_offline: bool | None = None) -> CacheSettings:
    """The settings of a reader: its folder (:func:`default_folder`); ``cache_limit`` (bytes, or a size such as
    ``"500G"``) or ``$MMIDX_CACHE_LIMIT``, a limit of 0 turning the data cache off; ``cache_offline`` or
    ``$MMIDX_CACHE_OFFLINE`` (1 or 0): open remote datasets from the cache alone."""
    folder = default_folder(cache_dir)
    if cache_limit is None and os.environ.get(CACHE_LIMIT_VARIABLE):
        try:
            cache_limit = parse_size(os.environ[CACHE_LIMIT_VARIABLE])
        except CacheError as error:
            raise CacheError(f"{CACHE_LIMIT_VARIABLE}: {error}") from None
    limit = None if cache_limit is None else parse_size(cache_limit)
    if cache_offline is None:
        flag = os.environ.get(CACHE_OFFLINE_VARIABLE, "").strip()
        if flag not in ("", "0", "1"):
            raise CacheError(f"{CACHE_OFFLINE_VARIABLE}={flag!r}: give 1 (open remote datasets from the node's cache "
                             "alone) or 0")
        cache_offline = flag == "1"
    return CacheSettings(Path(folder).absolute(), limit or None, bool(cache_offline))


def accounted(size: int) -> int:
    """The bytes a file of ``size`` bytes counts for: whole pages, as a filesystem stores it."""
    return -(-size // PAGE) * PAGE


def folder_bytes(folder: str | os.PathLike, seen: set[int] | None = None) -> int:
    """What ``folder`` and everything under it count for (:func:`accounted` files, one page a folder); 0 when
    it does not exist. Files are counted once each (by inode: one renamed while the walk goes on is not counted
    twice); files that vanish meanwhile (an eviction) are not counted."""
    seen = set() if seen is None else seen
    total = PAGE
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                total += folder_bytes(entry.path, seen)
                continue
            stat = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.st_ino not in seen:
            seen.add(stat.st_ino)
            total += accounted(stat.st_size)
    return total


def block_count(size: int, block_size: int) -> int:
    return max(1, -(-size // block_size))


def block_bytes(size: int, block_size: int, blocks: np.ndarray) -> np.ndarray:
    """The bytes of ``blocks`` of a file of ``size`` bytes (the last one may be short)."""
    return np.minimum(size - np.asarray(blocks, dtype=np.int64) * block_size, block_size)


def entry_bytes(size: int, block_size: int, blocks: np.ndarray) -> np.ndarray:
    """What the entries of ``blocks`` count for (header and bytes, in pages)."""
    return -(-(block_bytes(size, block_size, blocks) + HEADER) // PAGE) * PAGE


def role_bytes(size: int, block_size: int) -> int:
    """What a role's own files count for: its JSON, the two arrays and the folder of entries."""
    return 2 * accounted(8 * block_count(size, block_size)) + 2 * PAGE


def new_run() -> dict[str, Any]:
    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "hits": 0, "misses": 0, "bytes_fetched": 0,
            "bytes_from_cache": 0, "evicted": 0, "bypassed": 0, "dropped": 0}


def roles(data: Path) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(sha, role, its JSON) of every complete role in the cache folder ``data``."""
    for folder in sorted(data.glob("*")):
        if not SHA.fullmatch(folder.name) or not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.json")):
            try:
                meta = json.loads(path.read_text())
                if isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and meta["bytes"] > 0 \
                        and isinstance(meta.get("dataset"), str) and ROLE.fullmatch(path.stem):
                    yield folder.name, path.stem, meta
            except (OSError, ValueError):
                continue


def read_block_size(data: Path) -> int | None:
    """The block size ``cache.json`` records (None: no cache, or not one of this format)."""
    try:
        recorded = json.loads((data / "cache.json").read_text())
        size = recorded["block_size"] if recorded.get("format") == FORMAT else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return size if isinstance(size, int) and PAGE <= size <= 1 << 30 and size & (size - 1) == 0 else None


def create(folder: str | os.PathLike, block_size: int = BLOCK_SIZE) -> int:
    """Make the data cache of mmidx's cache folder ``folder`` unless it exists (its block size is fixed then:
    ``block_size``, a power of two of 4 KiB or more); the block size it has."""
    data = Path(folder) / "data"
    if (data / "cache.json").exists():
        recorded = read_block_size(data)
        if recorded is None:
            raise CacheError(f"{data}: not a data cache of this mmidx version (cache.json): empty it with "
                             "`mmidx cache clear` or give another --cache-dir")
        return recorded
    if block_size < PAGE or block_size & (block_size - 1):
        raise CacheError(f"a cache block of {block_size} bytes: give a power of two of {PAGE} or more")
    (data / "tmp").mkdir(parents=True, exist_ok=True)
    fresh = data / "tmp" / f"cache.json.{os.getpid()}"
    fresh.write_text(json.dumps({"format": FORMAT, "block_size": block_size}))
    try:
        os.replace(fresh, data / "cache.json")
    except FileNotFoundError:  # another process repairing the folder deleted it: it made the cache first
        recorded = read_block_size(data)
        if recorded is None:
            raise
        return recorded
    return block_size


def checked(settings: CacheSettings, block_size: int = BLOCK_SIZE) -> int:
    """The block size of the data cache ``settings`` names, made if need be; a :class:`CacheError` saying what to
    do for a folder it cannot write or a limit too small to hold blocks."""
    try:
        block_size = create(settings.folder, block_size)
        (settings.data / "tmp").mkdir(exist_ok=True)
        if not os.access(settings.data, os.W_OK) or not os.access(settings.data / "tmp", os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as error:
        raise CacheError(f"{settings.data}: the data cache cannot be written there ({error.strerror}): give a "
                         "writable --cache-dir (MMIDX_CACHE_DIR), or no --cache-limit to read uncached") from None
    smallest = smallest_limit(block_size)
    if settings.limit is not None and settings.limit < smallest:
        raise CacheError(f"cache limit {settings.limit:,} bytes holds fewer than {MIN_BLOCKS} blocks of "
                         f"{block_size:,} with the cache's own files: give at least {smallest:,} (a node's cache is "
                         "usually tens of GB), or 0 to read uncached")
    return block_size


def smallest_limit(block_size: int) -> int:
    """The smallest limit accepted: what the folder counts for holding :data:`MIN_BLOCKS` blocks of one file of
    up to 512 blocks (its own files, the dataset's folder, the file's JSON, arrays and folder, the entries). A
    larger file's arrays take more (16 bytes a block), so a limit this small bypasses the cache for it."""
    blocks = np.arange(MIN_BLOCKS)
    return (FOLDER_PAGES + 1) * PAGE + role_bytes(MIN_BLOCKS * block_size, block_size) + \
        int(entry_bytes(MIN_BLOCKS * block_size, block_size, blocks).sum())


def read_state(data: Path) -> dict[str, Any]:
    """The state as last saved (a snapshot read without the lock; {} when there is none)."""
    try:
        state = json.loads((data / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}
