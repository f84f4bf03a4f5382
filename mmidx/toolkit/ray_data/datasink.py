"""``write_mmidx``: a Ray Dataset of t2i rows (an image and captions) written as an mmidx dataset.

The rows are built as ``mmidx build --source hf`` builds the rows of one file (:mod:`mmidx.sources.hf`:
the same columns, defaults, skips and warnings): each write task checks and probes its rows' images and
tokenizes their captions into a shard, and the driver merges the shards in the Dataset's order. A build
draws each sample's views from (seed, file name, row in the file); here the file is ``source_name`` and the
row the row's number in the Dataset, counted over skipped rows too, so the views are drawn at the merge,
once every task's row count is known. The result is therefore the dataset ``mmidx build --source hf`` makes
of the same rows saved as one file named ``source_name``, byte for byte in its ``bin``, ``idx``, ``images`` and
``plan`` files, whatever the blocks, tasks or retries.

Shards are staged beside the output (``PREFIX.ray-shards``): a local prefix needs a folder every node sees
(a shared filesystem); an object-storage prefix stages and writes there. A dataset already at the prefix, local
or in object storage, is replaced only with ``overwrite=True``; without it, the prefix is checked when the job
starts and again just before the dataset is written (the upload, or the local files' rename), so a dataset
written there while the job ran is not replaced either.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any

from mmidx import __version__
from mmidx.errors import MMIDXError, import_extra
from mmidx.ingest.report import BuildReport, add_counts, count_skip, count_warning, judge, new_counts
from mmidx.ingest.shard import load_tokenizer
from mmidx.ingest.writer import DatasetBuilder
from mmidx.io.storage import delete_folder, existing_files, file_uri, is_remote, join, local_path, upload_dataset
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources import Skip, SourceContext, SourceOptions
from mmidx.sources.common import caption_views, samples_of
from mmidx.sources.elements import StoredImage
from mmidx.sources.hf import row_sample, row_spec

ray = import_extra("ray", "ray", "mmidx.toolkit.ray_data")
from ray.data import Datasink  # noqa: E402  (after the one-line message of a missing Ray)


class RayWriteError(MMIDXError, RuntimeError):
    """A Ray Dataset could not be written as an mmidx dataset (the message says why and what to do)."""


def _shard_location(staging: str, task: int) -> str:
    name = f"{task:05d}-{secrets.token_hex(4)}/shard"  # each attempt its own: retried tasks never mix
    return join(staging, name) if is_remote(staging) else os.path.join(staging, name)


class MMIDXDatasink(Datasink):
    """Writes t2i rows as the mmidx dataset at ``prefix`` (see the module docstring); ``report`` once done."""

    def __init__(self, prefix: str | os.PathLike, tokenizer: str, options: SourceOptions | None = None,
                 source_name: str = "rows", max_skip_rate: float = 0.01, overwrite: bool = False):
        prefix, self.options = local_path(os.fspath(prefix)), options or SourceOptions()
        self.prefix = prefix if is_remote(prefix) else os.path.abspath(prefix)  # tasks run in other folders
        self.tokenizer = os.path.abspath(tokenizer) if os.path.isdir(tokenizer) else tokenizer
        self.source_name, self.max_skip_rate, self.overwrite = source_name, max_skip_rate, overwrite
        self.staging = self.prefix + ".ray-shards"
        self.identity: dict[str, Any] = {}
        self.report: BuildReport | None = None
        self.started = 0.0

    def _refuse_a_dataset_there(self, since: str) -> None:
        """Unless ``overwrite``, refuse to write over any dataset file at the prefix (``since``: since when)."""
        if not self.overwrite and (found := existing_files(self.prefix)):
            files = ", ".join(file_uri(self.prefix, role) for role in found)
            raise RayWriteError(f"{self.prefix}: a dataset is there {since} ({files}); pass overwrite=True to replace "
                                "it, or write to another prefix (nothing was written there)")

    def on_write_start(self, schema: Any = None) -> None:
        self._refuse_a_dataset_there("already")
        self.started = time.perf_counter()
        self.identity = load_tokenizer(self.tokenizer, fresh=True).identity
        if schema is not None:
            spec = row_spec(schema, self.options, "the Ray Dataset")
            if spec.conversation:
                raise RayWriteError("write_mmidx writes t2i rows (an image and captions); build conversation rows "
                                    "with mmidx build --source hf")
        self._clear_staging()

    def _clear_staging(self) -> None:
        if is_remote(self.staging):
            delete_folder(self.staging)
        else:
            shutil.rmtree(self.staging, ignore_errors=True)

    def write(self, blocks: Any, ctx: Any) -> dict[str, Any]:
        """Build this task's rows into a shard; returns where it is and the task's counts (rows counted locally)."""
        tokenizer = load_tokenizer(self.tokenizer)
        if tokenizer.identity != self.identity:
            raise RayWriteError(f"the tokenizer {self.tokenizer!r} on {os.uname().nodename} differs from the driver's")
        context = SourceContext(tokenizer, self.options)
        counts, rows = new_counts(), 0
        location = _shard_location(self.staging, ctx.task_idx)
        local = tempfile.mkdtemp(prefix="mmidx-ray-") if is_remote(location) else os.path.dirname(location)
        local_prefix = os.path.join(local, "shard")
        os.makedirs(local, exist_ok=True)
        with DatasetBuilder(local_prefix, kind="multimodal", vocab_size=tokenizer.vocab_size,
                            tokenizer=self.identity, special_tokens=tokenizer.special_tokens,
                            check_images=False) as builder:  # row_sample checks each image (ingest_image)
            for block in blocks:
                table = ray.data.block.BlockAccessor.for_block(block).to_arrow()
                if table.num_rows == 0:  # a block a filter emptied may have no columns at all
                    continue
                spec = row_spec(table.schema, self.options, "the Ray Dataset")
                records = ((rows + i, record) for i, record in enumerate(table.select(spec.columns).to_pylist()))
                for item in samples_of(records, lambda row, record, spec=spec: row_sample(
                        row, record, spec, self.source_name, self.options.image_root, context)):
                    counts["rows"] += 1
                    if isinstance(item, Skip):
                        count_skip(counts, item, self.source_name, False)
                        continue
                    builder.add_sample(item.texts, item.images, item.views, (0, item.row), item.extra)
                    for reason, detail in item.warnings:
                        count_warning(counts, reason, item.row, detail, self.source_name, False)
                rows += table.num_rows
            builder.finalize()
        if local != os.path.dirname(location):
            upload_dataset(local_prefix, location)
            shutil.rmtree(local, ignore_errors=True)
        return {"task": ctx.task_idx, "shard": location, "rows": rows, "counts": counts}

    def on_write_complete(self, write_result: Any) -> None:
        """Merge the shards in task order, drawing each sample's views from its row in the whole Dataset."""
        returns = sorted(write_result.write_returns, key=lambda result: result["task"])
        output = tempfile.mkdtemp(prefix="mmidx-ray-") if is_remote(self.prefix) else None
        local_prefix = os.path.join(output, "out") if output else self.prefix
        tokenizer = load_tokenizer(self.tokenizer)
        context = SourceContext(tokenizer, self.options)
        config = {"mmidx": __version__, "source": "hf", "writer": "mmidx.toolkit.ray_data.write_mmidx",
                  "inputs": [self.source_name], "options": asdict(self.options), "tokenizer": self.identity}
        totals, offset = new_counts(), 0
        with DatasetBuilder(local_prefix, kind="multimodal", vocab_size=tokenizer.vocab_size,
                            tokenizer=self.identity, special_tokens=tokenizer.special_tokens,
                            build_config=config, check_images=False) as builder:  # the shards' checked images
            source = builder.source_id(self.source_name)
            for result in returns:
                shard = MMIDXDataset(result["shard"])
                for index in range(len(shard)):
                    sample = shard[index]
                    row = offset + sample.origin[1]
                    images = [StoredImage(bytes(image.data), image.width, image.height, image.format, image.mode,
                                          image.has_transparency) for image in sample.images]
                    views = caption_views(context.rng(self.source_name, row), sample.num_texts, self.options.views)
                    builder.add_sample(sample.texts, images, views, (source, row), sample.extra or None)
                    totals["views"] += len(views)
                    totals["images"] += len(images)
                    totals["tokens"] += sum(map(len, sample.texts))
                _shift_examples(result["counts"], offset)
                add_counts(totals, result["counts"])
                totals["samples"] += len(shard)
                offset += result["rows"]
            if not totals["samples"]:  # leaves no dataset behind, as a build that built nothing
                raise RayWriteError(BuildReport({**judge(totals, self.max_skip_rate), "output": self.prefix,
                                                 "units": len(returns), "reused_units": 0}).summary())
            if not output:  # the local files are renamed into place by finalize
                self._refuse_a_dataset_there("now, written while this job ran")
            builder.finalize()
        if output:
            try:
                self._refuse_a_dataset_there("now, written while this job ran")
                upload_dataset(local_prefix, self.prefix)
            finally:
                shutil.rmtree(output, ignore_errors=True)
        self._clear_staging()
        totals["seconds"]["wall"] = time.perf_counter() - self.started
        self.report = BuildReport({**judge(totals, self.max_skip_rate), "output": self.prefix, "units": len(returns),
                                   "reused_units": 0})

    def on_write_failed(self, error: Exception) -> None:
        self._clear_staging()


def _shift_examples(counts: dict[str, Any], offset: int) -> None:
    """A task's skip and warning examples name rows of the task; make them rows of the whole Dataset."""
    for table in ("skips", "warnings"):
        for entry in counts[table].values():
            for example in entry["examples"]:
                example["row"] += offset


def write_mmidx(ds: Any, prefix: str | os.PathLike, tokenizer: str, *, views: int = 4, seed: int = 0,
                image_column: str | None = None, caption_columns: tuple[str, ...] = (),
                keep_columns: tuple[str, ...] = (), max_image_size: int | None = None, source_name: str = "rows",
                max_skip_rate: float = 0.01, overwrite: bool = False,
                ray_remote_args: dict[str, Any] | None = None) -> BuildReport:
    """Write the Ray Dataset ``ds`` of t2i rows as the mmidx dataset at ``prefix`` and return the build report.

    Columns and options as ``mmidx build --source hf`` takes them (``image_column``, ``caption_columns``,
    ``keep_columns``, ``views``, ``seed``); the dataset is the one that build makes of the same rows saved as
    one file named ``source_name`` (see the module docstring). The Dataset's order is kept while writing.
    """
    options = replace(SourceOptions(), views=views, seed=seed, image_column=image_column,
                      caption_columns=tuple(caption_columns), keep_columns=tuple(keep_columns),
                      max_image_size=max_image_size)
    sink = MMIDXDatasink(prefix, tokenizer, options, source_name, max_skip_rate, overwrite)
    context = ray.data.DataContext.get_current()
    preserve = context.execution_options.preserve_order
    context.execution_options.preserve_order = True  # tasks numbered in the Dataset's order
    try:
        ds.write_datasink(sink, ray_remote_args=ray_remote_args or {})
    finally:
        context.execution_options.preserve_order = preserve
    if sink.report is None:
        raise RayWriteError("the Ray Dataset was written without calling on_write_complete: nothing to report")
    return sink.report
