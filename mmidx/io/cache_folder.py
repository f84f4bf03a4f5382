"""The folder of a node's remote-data cache: its settings, its layout and its accounting.

**Settings.** ``cache_dir`` (``--cache-dir``, ``$MMIDX_CACHE_DIR``, default ``~/.cache/mmidx``) is mmidx's cache
folder: remote datasets' small files live in ``DIR/remote/``, the data blocks in ``DIR/data/``. The data cache is
on when a limit is given (``cache_limit``, ``--cache-limit``, ``$MMIDX_CACHE_LIMIT``; 0 turns it off): a cache
that may fill a node's disk is worse than none, so there is no default limit.

**Layout of** ``DIR/data``::

    cache.json              {"format": 1, "block_size": B}, written once: every entry is one block of B bytes
    state.json              the accounting: bytes used, the last run's counters (changed under the lock)
    lock, users             flock'd: ``lock`` while the accounting changes; ``users`` shared by every process
                            with the cache open (an exclusive try that succeeds starts a new run)
    tmp/                    entries being written (only under the lock: one found there is a dead writer's)
    SHA/ROLE.json           what the file is: the dataset's URI, the object's, its size
    SHA/ROLE.present        uint64 a block: when it was stored, 0 when absent (changed under the lock)
    SHA/ROLE.used           uint64 a block: when it was last read (a hint readers write without the lock)
    SHA/ROLE/BLOCK          an entry: MAGIC, the xxh3-64 of the key and the bytes, then the block's bytes

``SHA`` is the ``meta_sha256`` of the JSON describing the file (the dataset's metadata, or a precached
encoding's), so a changed dataset never serves stale bytes. Sizes are counted as a filesystem stores them:
each file in whole 4 KiB pages, each folder one page (:func:`folder_bytes`); the limit bounds that sum.

``mmidx cache info`` and ``clear`` are :mod:`mmidx.io.cache_admin`'s.

**Crash safety.** Whoever holds the lock marks the state busy before changing anything and clears the mark
after; a holder that finds the mark (its predecessor was killed mid-change) or a state written before the
machine's last boot rebuilds the accounting from the files (:func:`repair`), deleting temporaries.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmidx.errors import MMIDXError

CACHE_DIR_VARIABLE, CACHE_LIMIT_VARIABLE = "MMIDX_CACHE_DIR", "MMIDX_CACHE_LIMIT"
BLOCK_SIZE = 1 << 20  # the default block (see docs/guide/storage.md: why a fixed block, why this size)
PAGE = 4096
FORMAT = 1
MAGIC = b"MMIDXBK1"
HEADER = len(MAGIC) + 8  # the magic, then the digest
MIN_BLOCKS = 4  # a limit must hold this many blocks
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
    if value < 0:
        raise CacheError(f"{text!r}: a cache limit is not negative (0 turns the data cache off)")
    return value


@dataclass(frozen=True)
class CacheSettings:
    """Where a reader caches: ``folder`` (small files in ``folder/remote``, data blocks in ``folder/data``) and
    ``limit``, the bytes the data blocks may take (None: data is read uncached)."""

    folder: Path
    limit: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "folder", Path(self.folder))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled into every worker with its dataset: a string, not a Path
        return CacheSettings, (os.fspath(self.folder), self.limit)

    @property
    def data(self) -> Path:
        """The data cache's own folder."""
        return self.folder / "data"


def default_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """mmidx's cache folder: ``cache_dir``, else ``$MMIDX_CACHE_DIR``, else ``~/.cache/mmidx``."""
    return Path(cache_dir or os.environ.get(CACHE_DIR_VARIABLE) or Path.home() / ".cache" / "mmidx")


def cache_settings(cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None) -> CacheSettings:
    """The settings of a reader: its folder (:func:`default_folder`); ``cache_limit`` (bytes, or a size such as
    ``"500G"``) or ``$MMIDX_CACHE_LIMIT``; a limit of 0 turns the data cache off."""
    folder = default_folder(cache_dir)
    if cache_limit is None and os.environ.get(CACHE_LIMIT_VARIABLE):
        try:
            cache_limit = parse_size(os.environ[CACHE_LIMIT_VARIABLE])
        except CacheError as error:
            raise CacheError(f"{CACHE_LIMIT_VARIABLE}: {error}") from None
    limit = None if cache_limit is None else parse_size(cache_limit)
    return CacheSettings(Path(folder).absolute(), limit or None)


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


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


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


class Accounting:
    """The lock and ``state.json`` of a cache folder, for one process: :meth:`hold` is the only way to change
    what the cache holds."""

    def __init__(self, data: Path, block_size: int):
        self.data, self.block_size = data, block_size
        self._fd = os.open(data / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        self._threads = threading.Lock()

    @contextmanager
    def hold(self) -> Iterator[dict[str, Any]]:
        """The state, under the lock, marked busy until the block ends (an exception leaves it busy, for the
        next holder to repair); saved when the block ends."""
        with self._threads:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
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

    def close(self) -> None:
        os.close(self._fd)

    def _load(self) -> dict[str, Any] | None:
        try:
            state = json.loads((self.data / "state.json").read_text())
        except (OSError, ValueError):
            return None
        valid = isinstance(state, dict) and isinstance(state.get("bytes"), int) and isinstance(state.get("run"), dict)
        return state if valid else None

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
    smallest = MIN_BLOCKS * block_size
    if settings.limit is not None and settings.limit < smallest:
        raise CacheError(f"cache limit {settings.limit:,} bytes holds fewer than {MIN_BLOCKS} blocks of "
                         f"{block_size:,}: give at least {smallest:,} (a node's cache is usually tens of GB), or 0 "
                         "to read uncached")
    return block_size


def read_state(data: Path) -> dict[str, Any]:
    """The state as last saved (a snapshot read without the lock; {} when there is none)."""
    try:
        state = json.loads((data / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}
