"""Small files written whole and crash-safely (JSON under a temporary name, renamed into place), their
digests, and OSErrors that name the file they concern.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmidx import format as fmt


@contextlib.contextmanager
def errors_naming(path: str | os.PathLike) -> Iterator[None]:
    """Let an OSError of the block (disk full, I/O error) name ``path``: the kernel's write errors name no file."""
    try:
        yield
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror or str(error), os.fspath(path)) from error


def digest(obj: Any) -> str:
    return hashlib.sha256(fmt.canonical_json(obj)).hexdigest()


STALE_PARTIAL_SECONDS = 60.0  # a temporary untouched this long, of a process not running here, is a dead one's
_PARTIAL = re.compile(r"\.(\d+)-[0-9a-f]+\.partial")


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_stale_partials(path: str | os.PathLike, min_age: float = STALE_PARTIAL_SECONDS, *,
                          exclusive: bool = False) -> list[Path]:
    """Delete the ``PATH.<pid>-<hex>.partial`` temporaries a killed writer of ``path`` left (``kill -9`` between
    writing and renaming); returns what was deleted.

    ``exclusive``: the caller holds the lock every writer of ``path`` holds while it writes (a build's report
    is written under the output's lock, :func:`mmidx.io.lock.output_lock`), so no other writer of ``path`` is
    alive and every temporary of it is a dead one's, whatever its pid (a dead writer's pid may belong to another
    process by now) or its age. Otherwise safely: a temporary is another writer's in progress, and kept, while its
    process runs on this machine or it was modified less than ``min_age`` seconds ago (a writer on another node
    sharing the folder, whose process this machine cannot see, writes and renames a small file within
    milliseconds).
    """
    path = Path(path)
    removed = []
    try:
        entries = list(path.parent.glob(glob.escape(path.name) + ".*.partial"))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        match = _PARTIAL.fullmatch(entry.name[len(path.name):])
        if match is None:
            continue
        if not exclusive and (int(match[1]) == os.getpid() or _running(int(match[1]))):
            continue
        try:
            if not exclusive and now - entry.stat().st_mtime < min_age:
                continue
            entry.unlink()
        except FileNotFoundError:  # its writer (or another cleaner) got there first
            continue
        removed.append(entry)
    return removed


def write_json(path: str | os.PathLike, obj: dict[str, Any], *, exclusive: bool = False) -> None:
    """Write ``obj`` to ``path`` atomically (temporary file, fsync, rename); no temporary is left on failure,
    and those a killed earlier writer left are removed (:func:`remove_stale_partials`; ``exclusive``: the caller
    holds the lock of every writer of ``path``, so all of them are)."""
    path = Path(path)
    remove_stale_partials(path, exclusive=exclusive)
    temporary = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")  # nodes may share it
    try:
        with errors_naming(temporary), open(temporary, "w") as stream:
            json.dump(obj, stream, indent=1, sort_keys=True)
            stream.write("\n")
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_json(path: str | os.PathLike) -> dict[str, Any] | None:
    try:
        with open(path) as stream:
            loaded = json.load(stream)
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None
