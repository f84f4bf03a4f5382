"""Builds whose output is in object storage: built in local scratch, shards and dataset uploaded safely.

The scratch folder is named by the output URI (under ``$MMIDX_CACHE_DIR``), so a rerun on the same
machine reuses the shards and the finished local dataset there. Each unit's shard is also uploaded
to ``OUTPUT.shards/NNNNN/`` as soon as it is published (its ``report.json`` last), so a rerun
anywhere else first restores the finished remote shards and builds only the rest. The dataset's
upload writes the data files first and ``.idx`` and ``.meta.json`` last
(:func:`mmidx.io.storage.upload_dataset`), so no stopped build leaves a remote dataset that opens; then
the remote shards are deleted, and a rerun uploads nothing when the dataset is there. A build that ends sharded
(past 64 units: :func:`mmidx.ingest.merge.finish_build`) keeps the uploaded shards, which are its dataset's
(``OUTPUT.shards/NNNNN/shard.*``), and uploads only its table and metadata: its end takes seconds there too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmidx import format as fmt
from mmidx.errors import option
from mmidx.ingest.plan import BuildError, BuildOptions
from mmidx.ingest.report import BuildReport, report_path
from mmidx.io.files import read_json
from mmidx.io.storage import (
    cache_root,
    delete_folder,
    download,
    join,
    list_objects,
    remote_metadata,
    shard_numbers,
    upload,
    upload_dataset,
)

REPORT = "report.json"  # written last into a shard folder: its presence says the shard is whole


def scratch_prefix(output: str) -> Path:
    """The local prefix a build for the remote ``output`` writes before uploading."""
    name = output.partition("?")[0].rstrip("/").rsplit("/", 1)[-1]
    return cache_root() / "builds" / hashlib.sha256(output.encode()).hexdigest()[:16] / name


def upload_shard(folder: Path, shards_uri: str) -> None:
    """Copy a published shard folder to ``shards_uri/NAME/``, its report last."""
    names = sorted(os.listdir(folder), key=lambda name: name == REPORT)
    for name in names:
        upload(folder / name, join(shards_uri, f"{folder.name}/{name}"))


def restore_shards(shards_uri: str, local_shards: Path) -> int:
    """Download every whole remote shard the local shards folder lacks; how many were restored.
    The build then reuses those whose report matches its unit (and rebuilds any other)."""
    folders: dict[str, list[str]] = {}
    for name in list_objects(shards_uri):
        folder, _, file = name.partition("/")
        if file and "/" not in file:
            folders.setdefault(folder, []).append(file)
    restored = 0
    for folder, files in folders.items():
        final = local_shards / folder
        if REPORT not in files or final.exists():
            continue
        staging = local_shards / f"{folder}.restore{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for file in files:
            download(join(shards_uri, f"{folder}/{file}"), staging / file)
        os.rename(staging, final)  # whole or not at all, as a local build publishes its shards
        restored += 1
    return restored


def _delete_other_shards(shards_uri: str, table: Path, meta: dict[str, Any]) -> None:
    """Delete the remote shard folders that the sharded dataset's table does not name (an earlier build's, of
    more units), as a local build does."""
    kept = {f"{number:05d}" for number in shard_numbers(table, meta)}
    stale = sorted({name.partition("/")[0] for name in list_objects(shards_uri)} - kept)
    for folder in stale:
        delete_folder(join(shards_uri, folder))


def _refuse_other_dataset(output: str, scratch: Path) -> None:
    """Refuse to replace a remote dataset that another build made (its metadata records another build
    configuration); a dataset of this build there (an older upload, or the same) is replaced or kept."""
    remote = remote_metadata(output)
    if remote is None:
        return
    try:
        theirs = json.loads(remote).get("build")
    except (ValueError, AttributeError):
        theirs = None  # not metadata a build wrote
    ours = (read_json(fmt.file_path(scratch, "meta")) or {}).get("build")
    if fmt.canonical_json(theirs) != fmt.canonical_json(ours):
        raise BuildError(f"{output} holds a dataset built from other inputs or options; pass {option('force', True)} "
                         "to replace it, or choose another output (this build is kept in local scratch: a rerun "
                         f"with {option('force', True)} only uploads it)")


def build_remote(options: BuildOptions,
                 build_local: Callable[[BuildOptions, Callable[[Path], None]], BuildReport]) -> BuildReport:
    """``build_local`` (:func:`mmidx.ingest.build_dataset`) into scratch, shards mirrored to storage as they
    finish, then the upload (if it succeeded)."""
    output = str(options.output)
    if options.num_nodes > 1:
        raise BuildError(f"{output}: a build split over nodes merges shard folders on a shared filesystem; "
                         "build to a local or shared --output, then upload it")
    scratch = scratch_prefix(output)
    shards_uri = join(output, ".shards", separator="")
    if not report_path(scratch).exists():  # no finished local build to reuse: take what another run uploaded
        restore_shards(shards_uri, Path(f"{scratch}.shards"))
    report = build_local(dataclasses.replace(options, output=str(scratch)),
                         lambda folder: upload_shard(folder, shards_uri))
    if not report.ok:
        return report
    if not options.force:
        _refuse_other_dataset(output, scratch)
    if report.data.get("layout") == "sharded":  # the uploaded shards are the dataset's: its table names them
        uploaded = upload_dataset(scratch, output, shards_uploaded=True)
        _delete_other_shards(shards_uri, fmt.file_path(scratch, "shards"), fmt.read_metadata(fmt.file_path(scratch,
                                                                                                          "meta")))
    else:
        uploaded = upload_dataset(scratch, output)
        delete_folder(shards_uri)
    note = f"uploaded to {output}" if uploaded else f"already at {output}"
    return BuildReport({**report.data, "output": output, "message": f"{report.message}; {note}"})
