"""Builds whose output is in object storage: built in local scratch, then uploaded safely.

The scratch folder is named by the output URI (under ``$MMIDX_CACHE_DIR``), so a rerun after a
killed build reuses the shards and the finished local dataset there; the upload writes the data
files first and ``.idx`` and ``.meta.json`` last (:func:`mmidx.storage.upload_dataset`), so no
stopped build leaves a remote dataset that opens, and a rerun uploads nothing when it is there.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

from mmidx.build.plan import BuildError, BuildOptions
from mmidx.build.report import BuildReport
from mmidx.storage import cache_root, upload_dataset


def scratch_prefix(output: str) -> Path:
    """The local prefix a build for the remote ``output`` writes before uploading."""
    name = output.partition("?")[0].rstrip("/").rsplit("/", 1)[-1]
    return cache_root() / "builds" / hashlib.sha256(output.encode()).hexdigest()[:16] / name


def build_remote(options: BuildOptions, build_local: Callable[[BuildOptions], BuildReport]) -> BuildReport:
    """``build_local`` (:func:`mmidx.build.build_dataset`) into scratch, then the upload (if it succeeded)."""
    output = str(options.output)
    if options.num_nodes > 1:
        raise BuildError(f"{output}: a build split over nodes merges shard folders on a shared filesystem; "
                         "build to a local or shared --output, then upload it")
    report = build_local(dataclasses.replace(options, output=str(scratch_prefix(output))))
    if not report.ok:
        return report
    uploaded = upload_dataset(scratch_prefix(output), output)
    note = f"uploaded to {output}" if uploaded else f"already at {output}"
    return BuildReport({**report.data, "output": output, "message": f"{report.message}; {note}"})
