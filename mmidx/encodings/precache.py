"""``mmidx precache``: run a frozen encoder once over a dataset's images or texts and store its outputs.

Each distinct (image, img_num) of the chosen element kind (or each text sequence) is one record.
Images go through the very transform a packed batch applies to them (same decode, same fused
resize-and-normalise kernel, so the encoder sees the pack's pixels bit for bit) and are batched by
output shape, so nothing is padded. The job is crash-safe and resumable like a build: values are
appended to ``P.enc.NAME.bin.partial``, and after each batch is on disk its records to
``P.enc.NAME.idx.partial``; a rerun keeps the whole batches both files hold and goes on, so the
finished streams are byte-identical to those of an uninterrupted run. The table and the JSON are
written last, under ``.partial`` names renamed into place (JSON last).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmidx import format as fmt
from mmidx.encodings.encode import (
    RECORD_SIZE,
    Job,
    RunOptions,
    Units,
    encode_batch,
    encoder_factory,
    load_encoder,
    plan_units,
)
from mmidx.images.transform import ImageTransform
from mmidx.io.files import errors_naming
from mmidx.io.lock import output_lock
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.encoding_streams import IMG_NUM_RULE, refuse_remote, write_table


class _Partial:
    """The ``.partial`` files of an interrupted or running job, and what they already hold."""

    def __init__(self, prefix: str, name: str, fingerprint: dict[str, Any], bounds: list[int]):
        self.paths = {role: Path(str(fmt.encoding_path(prefix, name, role)) + ".partial")
                      for role in fmt.ENCODING_ROLES}
        self.job_path = Path(str(fmt.encoding_path(prefix, name, "json")) + ".job")
        self.fingerprint = json.dumps(fingerprint, sort_keys=True)
        lines = self.job_path.read_text().split("\n") if self.job_path.exists() else []
        same = lines[:1] == [self.fingerprint]
        self.store = lines[1] if same and len(lines) > 1 else None  # what the encoder's output made of --store
        table = self.paths["idx"].read_bytes() if same and self.paths["idx"].exists() else b""
        done = len(table) // RECORD_SIZE
        self.batches = max(b for b in range(len(bounds)) if bounds[b] <= done)  # whole batches on disk
        self.records = np.frombuffer(table[: bounds[self.batches] * RECORD_SIZE], fmt.ENCODING_RECORD).copy()
        end = int(self.records["offset"][-1] + self.records["nbytes"][-1]) if len(self.records) else 0
        if not same or not self.paths["bin"].exists() or self.paths["bin"].stat().st_size < end:
            self.batches, self.records, end = 0, self.records[:0], 0
        if not same:
            with errors_naming(self.job_path):
                self.job_path.write_text(self.fingerprint)
        self.values = open(self.paths["bin"], "r+b" if end else "wb")
        self.values.truncate(end)
        self.values.seek(end)
        self.table = open(self.paths["idx"], "r+b" if len(self.records) else "wb")
        self.table.truncate(len(self.records) * RECORD_SIZE)
        self.table.seek(0, os.SEEK_END)

    def note_store(self, store: str) -> None:
        """Record (once) the store the encoder's output type gives, for a rerun that has no batch left to run."""
        if self.store != store:
            with errors_naming(self.job_path):
                self.job_path.write_text(f"{self.fingerprint}\n{store}")
            self.store = store

    def append(self, values: list[torch.Tensor], items: np.ndarray, img_nums: np.ndarray) -> None:
        """Write one batch's values (each at an aligned offset), fsync them, then its records."""
        records = np.zeros(len(values), fmt.ENCODING_RECORD)
        for record, value, item, img_num in zip(records, values, items, img_nums, strict=True):
            offset = fmt.aligned(self.values.tell(), fmt.ENCODING_ALIGNMENT)
            self.values.write(b"\0" * (offset - self.values.tell()))
            data = value.contiguous().view(-1).view(torch.uint8).numpy() if value.numel() else b""
            self.values.write(data)
            record["item"], record["img_num"], record["ndim"] = item, img_num, value.dim()
            record["shape"][: value.dim()] = value.shape
            record["offset"], record["nbytes"] = offset, value.numel() * value.element_size()
        with errors_naming(self.paths["bin"]):
            self.values.flush()
            os.fsync(self.values.fileno())
        with errors_naming(self.paths["idx"]):
            self.table.write(records.tobytes())
            self.table.flush()
            os.fsync(self.table.fileno())
        self.records = np.concatenate([self.records, records])

    def close(self) -> None:
        self.values.close()
        self.table.close()


SHAPE_RULES = {"image": "(C, h, w) per image; moments (2, C, h, w) = (mean, logvar)",
               "vit": "(h, w, D) per image: the encoder's (D, h, w) in ViT token order",
               "text": "(L, D) per sequence"}


def _transform_args(transform: ImageTransform | None) -> dict[str, Any] | None:
    return None if transform is None else json.loads(json.dumps(dataclasses.asdict(transform)))


def precache_dataset(prefix: str, job: Job, transform: ImageTransform | None, *, device: str = "cpu",
                     workers: int = 1, progress: bool = True, encoder: Callable[..., Any] | None = None,
                     engine: str = "local", ray_address: str | None = None) -> dict[str, Any]:
    """Compute (or finish computing) ``P.enc.NAME`` for the dataset at ``prefix``; returns its metadata.

    ``engine="ray"`` encodes on ``workers`` Ray actors (each loads the encoder once, on ``device``) and
    writes their batches here in order, so the streams are byte-identical to a local run's."""
    run = RunOptions(device, workers, progress, engine, ray_address, encoder)
    refuse_remote(prefix)
    dataset = MMIDXDataset(prefix)
    units = plan_units(dataset, job, transform if job.modality == "image" else None)
    transform_args = _transform_args(transform) if job.modality == "image" else None
    fingerprint = {**dataclasses.asdict(job), "transform_args": transform_args, "dataset": dataset.checksum}
    with output_lock(f"{prefix}.enc.{job.name}", "precache"):
        partial = _Partial(prefix, job.name, fingerprint, units.bounds)
        try:
            store = _run(dataset, job, transform, units, partial, run)
        finally:
            partial.close()
        return _commit(prefix, job, dataset, transform_args, units, partial, store)


def _run(dataset: MMIDXDataset, job: Job, transform: ImageTransform | None, units: Units, partial: _Partial,
         run: RunOptions) -> str:
    """Encode the batches the partial files do not hold yet, in order; returns the store recorded."""
    batches = len(units.bounds) - 1
    store = partial.store or job.store
    if partial.batches == batches:
        return store
    todo = range(partial.batches, batches)
    if run.engine == "ray":
        from mmidx.encodings.ray_precache import ray_batches

        results = ray_batches(dataset.prefix, job, transform, units, todo, run)
    else:
        results = _local_batches(dataset, job, transform, units, todo, run)
    started, done = time.perf_counter(), 0
    for b, (values, store) in zip(todo, results, strict=True):
        start, end = units.bounds[b], units.bounds[b + 1]
        partial.note_store(store)
        partial.append(list(values.unbind(0)), units.items[start:end], units.img_nums[start:end])
        done += end - start
        if run.progress:
            rate = done / max(time.perf_counter() - started, 1e-9)
            print(f"\rprecache {job.name}: {end}/{units.bounds[-1]} {job.modality}s ({rate:.1f}/s)",
                  end="", file=sys.stderr, flush=True)
    if run.progress:
        print(file=sys.stderr)
    return store


def _local_batches(dataset: MMIDXDataset, job: Job, transform: ImageTransform | None, units: Units,
                   todo: range, run: RunOptions) -> Iterator[tuple[torch.Tensor, str]]:
    """Batches ``todo`` encoded in this process (decode and transform on ``run.workers`` threads)."""
    encoder = run.encoder if run.encoder is not None else load_encoder(job.encoder, run.device)
    pool = ThreadPoolExecutor(run.workers) if run.workers > 1 else None
    try:
        for b in todo:
            yield encode_batch(dataset, job, transform, units, b, encoder, run.device, pool)
    finally:
        if pool is not None:
            pool.shutdown()


def _commit(prefix: str, job: Job, dataset: MMIDXDataset, transform_args: dict[str, Any] | None, units: Units,
            partial: _Partial, store: str) -> dict[str, Any]:
    """Sort the records, write the table and the JSON, and rename everything into place (JSON last)."""
    records = partial.records[np.lexsort((partial.records["img_num"], partial.records["item"]))]
    write_table(partial.paths["idx"], records)
    files = {role: {"bytes": partial.paths[role].stat().st_size, fmt.FILE_HASH: fmt.hash_file(partial.paths[role])}
             for role in ("bin", "idx")}
    meta = {"format": "mmidx-encoding", "format_version": fmt.ENCODING_VERSION, "name": job.name,
            "modality": job.modality, "transform": job.transform if job.modality == "image" else None,
            "transform_args": transform_args, "img_num_rule": IMG_NUM_RULE if job.modality == "image" else None,
            "encoder": job.encoder, "weights_version": job.weights_version, "dtype": job.dtype, "store": store,
            "shape_rule": SHAPE_RULES["vit" if job.modality == "image" and job.transform == "vit" else job.modality],
            "dataset": {"checksum": dataset.checksum, "samples": len(dataset)},
            "counts": {"records": len(records)}, "files": files}
    fmt.write_metadata(partial.paths["json"], meta)  # the canonical form of P.meta.json
    final = {role: fmt.encoding_path(prefix, job.name, role) for role in fmt.ENCODING_ROLES}
    final["json"].unlink(missing_ok=True)  # the old stream stops opening before any of its files is replaced
    for role in fmt.ENCODING_ROLES:
        os.replace(partial.paths[role], final[role])
    partial.job_path.unlink(missing_ok=True)
    fmt.fsync_directory(Path(prefix).resolve().parent)
    return meta


def precache(path: str, job: Job, *, device: str = "cpu", workers: int = 1, progress: bool = True,
             engine: str = "local", ray_address: str | None = None) -> list[dict[str, Any]]:
    """Precache every dataset of a data YAML (each through its group's transform), or one dataset prefix
    (BAGEL's transforms for its source type); returns each stream's metadata."""
    from mmidx.config import config_for

    config = config_for([path])
    transforms: dict[str, ImageTransform | None] = {}
    for group in config.groups:
        transform = None if job.modality == "text" else group.vae_transform if job.transform == "vae" else \
            group.vit_transform
        for prefix in group.datasets:
            if transforms.setdefault(prefix, transform) != transform:
                raise ValueError(f"{prefix} is in groups with different {job.transform} transforms: one encoding "
                                 "stream has one transform; precache it under two names from two data YAMLs")
    # the encoder is loaded (locally) or its factory imported (Ray) once, before anything is written
    encoder = load_encoder(job.encoder, device) if engine == "local" else None
    if encoder is None:
        encoder_factory(job.encoder)
    return [precache_dataset(prefix, job, transform, device=device, workers=workers, progress=progress,
                             encoder=encoder, engine=engine, ray_address=ray_address)
            for prefix, transform in transforms.items()]
