"""Small files written whole and crash-safely (JSON under a temporary name, renamed into place), their
digests, and OSErrors that name the file they concern.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
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


def write_json(path: str | os.PathLike, obj: dict[str, Any]) -> None:
    """Write ``obj`` to ``path`` atomically (temporary file, fsync, rename); no temporary is left on failure."""
    path = Path(path)
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
