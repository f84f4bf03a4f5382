"""On-disk cache of index arrays, built once per job.

A cache entry is a folder named by a hash of everything the arrays depend on (its
``description.json`` holds that description in full), holding one ``.npy`` file per array and a
``stats.json``. It is written under a temporary name and renamed when complete, so a crash never
leaves an entry that looks finished; entries are loaded with mmap. Under ``torch.distributed``
rank 0 builds and every other rank waits on a barrier, then maps the same files.
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

Arrays = dict[str, np.ndarray]


def description_key(description: dict[str, Any]) -> str:
    """The folder name of a cache entry: a hash of its JSON description."""
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _distributed() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def cached_arrays(cache_dir: str | os.PathLike | None, description: dict[str, Any],
                  build: Callable[[], tuple[Arrays, dict[str, Any]]]) -> tuple[Arrays, dict[str, Any], Path | None]:
    """``build()``'s (arrays, stats), from ``cache_dir`` when an entry for ``description`` exists.

    Without a cache dir every process builds for itself. Returns the entry's folder too (or None).
    """
    if cache_dir is None:
        arrays, stats = build()
        return arrays, stats, None
    folder = Path(cache_dir) / description_key(description)
    dist = _distributed()
    if (dist is None or dist.get_rank() == 0) and not folder.exists():
        arrays, stats = build()
        _save(folder, arrays, stats, description)
    if dist is not None:
        dist.barrier()
    names = [path.stem for path in sorted(folder.glob("*.npy"))]
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in names}
    return arrays, json.loads((folder / "stats.json").read_text()), folder


def _save(folder: Path, arrays: Arrays, stats: dict[str, Any], description: dict[str, Any]) -> None:
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name, array in arrays.items():
        np.save(partial / f"{name}.npy", array)
    (partial / "stats.json").write_text(json.dumps(stats, indent=1, default=str))
    (partial / "description.json").write_text(json.dumps(description, indent=1, sort_keys=True, default=str))
    try:
        partial.rename(folder)
    except OSError:  # another process finished the same entry first; theirs is identical
        shutil.rmtree(partial, ignore_errors=True)
