"""``mmidx precache``: run frozen encoders once over a dataset's images or texts and store their outputs.

Encoders that read the same input run in one pass: each batch of images is read, decoded and transformed
once and fed to every encoder of that transform, each batch of texts made once (token ids, or strings)
and fed to every text encoder. Each distinct (image, img_num) of the chosen element kind (or each text
sequence) is one record. Images go through the very transform a packed batch applies to them (same
decode, same fused resize-and-normalise kernel, so the encoder sees the pack's pixels bit for bit) and
are batched by output shape, so nothing is padded. The job is crash-safe and resumable like a build:
values are appended to ``P.enc.NAME.bin.partial``, and after each batch is on disk its records to
``P.enc.NAME.idx.partial``; a rerun keeps the whole batches both files hold and goes on, so the finished
streams are byte-identical to those of an uninterrupted run (each encoding of a pass resumes from its
own last whole batch). The table and the JSON are written last, under ``.partial`` names renamed into
place (JSON last). A dataset in object storage is read through the same reader, its streams built in
local scratch (``$MMIDX_CACHE_DIR``, so a rerun resumes there) and uploaded beside it, data first and
the JSON last, as ``mmidx build --output s3://`` uploads a dataset.
"""

from __future__ import annotations

import contextlib
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
    json_safe,
    load_encoder,
    plan_units,
)
from mmidx.errors import MMIDXError, option
from mmidx.format import FormatError
from mmidx.images.transform import ImageTransform
from mmidx.ingest.remote import scratch_prefix
from mmidx.io.files import errors_naming
from mmidx.io.lock import output_lock
from mmidx.io.storage import is_remote
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.encoding_streams import (
    IMG_NUM_RULE,
    EncodingStream,
    encoding_names,
    stream_location,
    stream_version,
    upload_stream,
    write_table,
)


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
               "text": "(L, D) per sequence",
               "text_input": "(n, D) per text: the encoder's rows for the text's string (its masked-in rows "
                             "with store_pad_tokens false)"}


def _transform_args(transform: ImageTransform | None) -> dict[str, Any] | None:
    return None if transform is None else json_safe(dataclasses.asdict(transform))


class StreamExistsError(MMIDXError, ValueError):
    """A finished encoding of the same name, computed by another encoder or options, would be replaced."""


def _refuse_other_stream(dataset: MMIDXDataset, job: Job, transform_args: dict[str, Any] | None) -> None:
    """Refuse to replace the finished stream ``P.enc.NAME`` of this dataset when another encoder or other options
    computed it (a run with ``force`` replaces it). The same job's stream is computed again (the same bytes); a
    stream of another version of the dataset, or one that does not open, serves no reader and is replaced."""
    if job.name not in encoding_names(dataset.prefix):
        return
    try:
        meta = EncodingStream.open(dataset.prefix, job.name).meta
    except FormatError:
        return
    if meta["dataset"].get("checksum") != dataset.checksum:
        return
    image = job.modality == "image"
    ours = {"modality": job.modality, "encoder": job.encoder, "weights_version": job.weights_version,
            "dtype": job.dtype, "transform": job.transform if image else None, "transform_args": transform_args,
            "store": meta.get("store") if meta.get("store") == "tensor" else job.store}  # "tensor": one output
    if job.modality == "text" and job.input == "text":
        ours.update(input="text", store_pad_tokens=job.store_pad_tokens, encoder_kwargs=json_safe(job.encoder_kwargs))
    differ = [f"{key} {meta.get(key)!r} vs {value!r}" for key, value in ours.items() if meta.get(key) != value]
    if differ:
        raise StreamExistsError(f"{stream_location(dataset.prefix, job.name, 'json')}: encoding {job.name!r} was "
                                f"computed with other options ({'; '.join(differ)}); pass {option('force', True)} "
                                f"to replace it, or choose another {option('name')}")


def precache_dataset(prefix: str, job: Job, transform: ImageTransform | None, *, device: str = "cpu",
                     workers: int = 1, progress: bool = True, encoder: Callable[..., Any] | None = None,
                     engine: str = "local", ray_address: str | None = None, force: bool = False) -> dict[str, Any]:
    """Compute (or finish computing) ``P.enc.NAME`` for the dataset at ``prefix``; returns its metadata.

    ``engine="ray"`` encodes on ``workers`` Ray actors (each loads the encoder once, on ``device``) and
    writes their batches here in order, so the streams are byte-identical to a local run's. A finished stream
    ``NAME`` that another encoder or other options computed is replaced only with ``force``."""
    run = RunOptions(device, workers, progress, engine, ray_address, None if encoder is None else [encoder], force)
    return precache_pass(prefix, [job], {job.transform: transform}, run)[0]


def precache_pass(prefix: str, jobs: list[Job], transforms: dict[str, ImageTransform | None],
                  run: RunOptions) -> list[dict[str, Any]]:
    """Compute (or finish) every job's stream for the dataset at ``prefix`` (a path or a URI), the jobs that
    read the same input in one pass; ``transforms`` gives the "vae" and "vit" transforms; returns each
    stream's metadata, in the order of ``jobs``. A sharded dataset's streams are written beside each of its shards,
    a shard at a time; what is returned of each is then the summary of its shards' streams."""
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"encoding keys {sorted(n for n in set(names) if names.count(n) > 1)} appear twice: "
                         "each stream needs its own key")
    dataset = MMIDXDataset(prefix)
    if dataset.is_sharded:  # each shard's streams beside it: a pack reads a sample's encodings from its shard
        shards = [precache_pass(part.dataset.prefix, jobs, transforms, run) for part in dataset.parts]
        return [_sharded_summary(dataset, [metas[number] for metas in shards]) for number in range(len(jobs))]
    remote = is_remote(prefix)
    local = str(scratch_prefix(prefix)) if remote else prefix
    if remote:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
    metas: dict[str, dict[str, Any]] = {}
    passes: dict[tuple[Any, ...], list[int]] = {}
    for number, job in enumerate(jobs):
        passes.setdefault(job.reads, []).append(number)
    for numbers in passes.values():
        chosen = [jobs[n] for n in numbers]
        encoders = [run.encoders[n] for n in numbers] if run.encoders is not None else None
        transform = transforms.get(chosen[0].transform) if chosen[0].modality == "image" else None
        for meta in _one_pass(dataset, local, chosen, transform, dataclasses.replace(run, encoders=encoders)):
            metas[meta["name"]] = meta
    if remote:
        for job in jobs:
            upload_stream(local, prefix, job.name)
    return [metas[name] for name in names]


def _sharded_summary(dataset: MMIDXDataset, metas: list[dict[str, Any]]) -> dict[str, Any]:
    """What a precache of a sharded dataset reports of one encoding: its shards' streams (each has its own
    metadata beside its shard) in all: the records they hold, over ``shards`` streams."""
    first = metas[0]
    return {"name": first["name"], "modality": first["modality"], "store": first["store"], "dtype": first["dtype"],
            "counts": {"records": sum(meta["counts"]["records"] for meta in metas)},
            "dataset": {"checksum": dataset.checksum, "samples": len(dataset)}, "shards": len(metas)}


def _one_pass(dataset: MMIDXDataset, local: str, jobs: list[Job], transform: ImageTransform | None,
              run: RunOptions) -> list[dict[str, Any]]:
    """The jobs that read the same input, in one pass over the dataset; their streams written at ``local``."""
    units = plan_units(dataset, jobs[0], transform)
    transform_args = _transform_args(transform) if jobs[0].modality == "image" else None
    with contextlib.ExitStack() as stack:
        partials = []
        for job in jobs:
            stack.enter_context(output_lock(f"{local}.enc.{job.name}", "precache"))
            if not run.force:
                _refuse_other_stream(dataset, job, transform_args)
            fingerprint = {**job.fingerprint, "transform_args": transform_args, "dataset": dataset.checksum}
            partials.append(_Partial(local, job.name, fingerprint, units.bounds))
            stack.callback(partials[-1].close)
        stores = _run(dataset, jobs, transform, units, partials, run)
        for partial in partials:
            partial.close()
        return [_commit(local, job, dataset, transform_args, partial, store)
                for job, partial, store in zip(jobs, partials, stores, strict=True)]


def _run(dataset: MMIDXDataset, jobs: list[Job], transform: ImageTransform | None, units: Units,
         partials: list[_Partial], run: RunOptions) -> list[str]:
    """Encode the batches the partial files do not hold yet, in order; returns the store each job recorded."""
    batches = len(units.bounds) - 1
    stores = [partial.store or job.store for job, partial in zip(jobs, partials, strict=True)]
    first = min(partial.batches for partial in partials)
    if first == batches:
        return stores
    todo = range(first, batches)
    skips = [frozenset(n for n, partial in enumerate(partials) if partial.batches > b) for b in todo]
    if run.engine == "ray":
        from mmidx.encodings.ray_precache import ray_batches

        results = ray_batches(dataset.prefix, jobs, transform, units, todo, skips, run)
    else:
        results = _local_batches(dataset, jobs, transform, units, todo, skips, run)
    started, done, name = time.perf_counter(), 0, "+".join(job.name for job in jobs)
    for b, outputs in zip(todo, results, strict=True):
        start, end = units.bounds[b], units.bounds[b + 1]
        for number, (partial, output) in enumerate(zip(partials, outputs, strict=True)):
            if output is None:
                continue
            values, stores[number] = output
            partial.note_store(stores[number])
            partial.append(values, units.items[start:end], units.img_nums[start:end])
        done += end - start
        if run.progress:
            rate = done / max(time.perf_counter() - started, 1e-9)
            print(f"\rprecache {name}: {end}/{units.bounds[-1]} {jobs[0].modality}s ({rate:.1f}/s)",
                  end="", file=sys.stderr, flush=True)
    if run.progress:
        print(file=sys.stderr)
    return stores


def _local_batches(dataset: MMIDXDataset, jobs: list[Job], transform: ImageTransform | None, units: Units,
                   todo: range, skips: list[frozenset[int]], run: RunOptions) \
        -> Iterator[list[tuple[list[torch.Tensor], str] | None]]:
    """Batches ``todo`` encoded in this process (decode and transform on ``run.workers`` threads)."""
    encoders = run.encoders if run.encoders is not None else [load_encoder(job, run.device) for job in jobs]
    pool = ThreadPoolExecutor(run.workers) if run.workers > 1 else None
    try:
        for b, skip in zip(todo, skips, strict=True):
            yield encode_batch(dataset, jobs, transform, units, b, encoders, run.device, pool, skip)
    finally:
        if pool is not None:
            pool.shutdown()


def _commit(prefix: str, job: Job, dataset: MMIDXDataset, transform_args: dict[str, Any] | None,
            partial: _Partial, store: str) -> dict[str, Any]:
    """Sort the records, write the table and the JSON, and rename everything into place (JSON last)."""
    records = partial.records[np.lexsort((partial.records["img_num"], partial.records["item"]))]
    text_input = job.modality == "text" and job.input == "text"
    version = stream_version(text_input)
    write_table(partial.paths["idx"], records, version)
    files = {role: {"bytes": partial.paths[role].stat().st_size, fmt.FILE_HASH: fmt.hash_file(partial.paths[role])}
             for role in ("bin", "idx")}
    meta = {"format": "mmidx-encoding", "format_version": version, "name": job.name,
            "modality": job.modality, "transform": job.transform if job.modality == "image" else None,
            "transform_args": transform_args, "img_num_rule": IMG_NUM_RULE if job.modality == "image" else None,
            "encoder": job.encoder, "weights_version": job.weights_version, "dtype": job.dtype, "store": store,
            "shape_rule": SHAPE_RULES["vit" if job.modality == "image" and job.transform == "vit" else
                                      "text_input" if text_input else job.modality],
            "dataset": {"checksum": dataset.checksum, "samples": len(dataset)},
            "counts": {"records": len(records)}, "files": files}
    if text_input:  # version 2: what the text encoder read, and whether pad rows were kept
        meta.update(input="text", store_pad_tokens=job.store_pad_tokens,
                    encoder_kwargs=json_safe(job.encoder_kwargs))
    fmt.write_metadata(partial.paths["json"], meta)  # the canonical form of P.meta.json
    final = {role: fmt.encoding_path(prefix, job.name, role) for role in fmt.ENCODING_ROLES}
    final["json"].unlink(missing_ok=True)  # the old stream stops opening before any of its files is replaced
    for role in fmt.ENCODING_ROLES:
        os.replace(partial.paths[role], final[role])
    partial.job_path.unlink(missing_ok=True)
    fmt.fsync_directory(Path(prefix).resolve().parent)
    return meta


def precache(path: str, jobs: Job | list[Job], *, device: str = "cpu", workers: int = 1, progress: bool = True,
             engine: str = "local", ray_address: str | None = None, force: bool = False) -> list[dict[str, Any]]:
    """Precache every dataset of a data YAML (each through its group's transforms), or one dataset prefix
    (BAGEL's transforms for its source type), local or in object storage, with every job (several
    encoders in one pass); returns each stream's metadata. A finished stream of a job's name that another
    encoder or other options computed is replaced only with ``force``."""
    from mmidx.config import config_for

    jobs = [jobs] if isinstance(jobs, Job) else list(jobs)
    config = config_for([path])
    transforms: dict[str, dict[str, ImageTransform | None]] = {}
    for group in config.groups:
        for prefix in group.datasets:
            used = transforms.setdefault(prefix, {"vae": group.vae_transform, "vit": group.vit_transform})
            for kind, transform in (("vae", group.vae_transform), ("vit", group.vit_transform)):
                if used[kind] != transform and any(j.modality == "image" and j.transform == kind for j in jobs):
                    raise ValueError(f"{prefix} is in groups with different {kind} transforms: one encoding stream "
                                     "has one transform; precache it under two names from two data YAMLs")
    # the encoders are loaded (locally) or their factories imported (Ray) once, before anything is written
    encoders = [load_encoder(job, device) for job in jobs] if engine == "local" else None
    if encoders is None:
        for job in jobs:
            encoder_factory(job.encoder)
    run = RunOptions(device, workers, progress, engine, ray_address, encoders, force)
    return [meta for prefix, used in transforms.items() for meta in precache_pass(prefix, jobs, used, run)]
