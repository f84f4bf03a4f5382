"""``read_mmidx``: mmidx datasets as a Ray Dataset, one row per sample, read by tasks over sample ranges."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from mmidx.config import DataConfig, is_data_yaml
from mmidx.errors import import_extra
from mmidx.ingest.shard import load_tokenizer
from mmidx.io.storage import is_remote, local_path
from mmidx.read.dataset import MMIDXDataset, Sample
from mmidx.toolkit.sample import dataset_tokenizer

ray = import_extra("ray", "ray", "mmidx.toolkit.ray_data")
from ray.data import Datasource, ReadTask  # noqa: E402  (after the one-line message of a missing Ray)
from ray.data.block import BlockMetadata  # noqa: E402

COLUMNS = {
    "dataset": pa.string(),  # the dataset's prefix (a data.yaml names several)
    "sample": pa.int64(),  # the sample's number in its dataset
    "texts": pa.list_(pa.string()),  # the texts decoded with the dataset's tokenizer
    "tokens": pa.list_(pa.list_(pa.int64())),  # the texts' token ids
    "images": pa.list_(pa.binary()),  # the stored (encoded) image bytes
    "image_sizes": pa.list_(pa.list_(pa.int32(), 2)),  # [width, height] of each image
    "origin_file": pa.string(),  # the input file the sample was built from
    "origin_row": pa.int64(),  # its row in that file
    "extra": pa.string(),  # the sample's extra JSON ("" if none)
}
DEFAULT_COLUMNS = tuple(name for name in COLUMNS if name != "tokens")
ROWS_PER_BLOCK = 256  # rows per yielded block (a read task yields its range block by block)


def dataset_prefixes(prefix_or_yaml: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The datasets a prefix, a list of prefixes or a ``data.yaml`` (every group's datasets, once each) names."""
    if isinstance(prefix_or_yaml, (str, os.PathLike)):
        location = os.fspath(prefix_or_yaml)
        if is_data_yaml(location):
            config = DataConfig.from_yaml(location)
            return list(dict.fromkeys(prefix for group in config.groups for prefix in group.datasets))
        prefixes = [location]
    else:
        prefixes = [os.fspath(prefix) for prefix in prefix_or_yaml]
    # absolute: tasks run in other folders
    return [prefix if is_remote(prefix) else os.path.abspath(local_path(prefix)) for prefix in prefixes]


def _row(dataset: MMIDXDataset, number: int, columns: Sequence[str], tokenizer: Any) -> dict[str, Any]:
    """Sample ``number`` of ``dataset`` as a row of ``columns`` (its number in the dataset: a sharded dataset's
    sample is read from its shard, where its number is another)."""
    sample: Sample = dataset[number]
    values: dict[str, Any] = {}
    for name in columns:
        if name == "dataset":
            values[name] = dataset.prefix
        elif name == "sample":
            values[name] = number
        elif name == "texts":
            values[name] = [tokenizer.decode(text.tolist()) for text in sample.texts]
        elif name == "tokens":
            values[name] = [text.tolist() for text in sample.texts]
        elif name == "images":
            values[name] = [bytes(image.data) for image in sample.images]
        elif name == "image_sizes":
            values[name] = [[image.width, image.height] for image in sample.images]
        elif name == "extra":
            values[name] = json.dumps(sample.extra, sort_keys=True, ensure_ascii=False) if sample.extra else ""
        else:
            values["origin_file"], values["origin_row"] = sample.origin
    return {name: values[name] for name in columns}


def _tokenizer(dataset: MMIDXDataset, location: str | None) -> Any:
    """The dataset's tokenizer, loaded from ``location`` (where the driver found it), if it is the same one."""
    if location is None:
        return None
    tokenizer = load_tokenizer(location)
    if tokenizer.sha256 != dataset.tokenizer["sha256"]:
        raise ValueError(f"{dataset.prefix}: the tokenizer at {location!r} on {os.uname().nodename} is not the one the "
                         "dataset was built with; every node must see the same tokenizer files")
    return tokenizer


def _read_range(prefix: str, start: int, stop: int, columns: tuple[str, ...],
                tokenizer_location: str | None) -> Iterator[pa.Table]:
    """Samples ``[start, stop)`` of the dataset at ``prefix`` as tables of up to ``ROWS_PER_BLOCK`` rows."""
    dataset = MMIDXDataset(prefix)
    tokenizer = _tokenizer(dataset, tokenizer_location)
    schema = pa.schema([(name, COLUMNS[name]) for name in columns])
    for first in range(start, stop, ROWS_PER_BLOCK):
        rows = [_row(dataset, index, columns, tokenizer) for index in range(first, min(first + ROWS_PER_BLOCK, stop))]
        yield pa.Table.from_pylist(rows, schema=schema)


class MMIDXDatasource(Datasource):
    """mmidx datasets as a Ray Data source: read tasks over contiguous sample ranges, one row per sample.

    Each task opens its dataset where it runs (local paths, or object-storage URIs read by ranged requests,
    as :class:`~mmidx.read.dataset.MMIDXDataset` reads them) and yields its rows in dataset order.
    """

    def __init__(self, prefixes: Sequence[str], columns: Sequence[str] = DEFAULT_COLUMNS):
        super().__init__()
        unknown = [name for name in columns if name not in COLUMNS]
        if unknown or not columns:
            raise ValueError(f"unknown columns {unknown}; choose from {', '.join(COLUMNS)}")
        self.columns = tuple(columns)
        self._sizes: list[tuple[str, int, int]] = []  # (prefix, samples, bytes)
        self._tokenizers: dict[str, str | None] = {}  # prefix → where its tokenizer is (absolute if local)
        for prefix in prefixes:
            dataset = MMIDXDataset(prefix)
            if dataset.kind != "multimodal":
                raise ValueError(f"{dataset.prefix}: a {dataset.kind} dataset; read_mmidx reads multimodal datasets")
            self._tokenizers[dataset.prefix] = None
            if "texts" in self.columns:
                tokenizer, why = dataset_tokenizer(dataset)
                if tokenizer is None:
                    raise ValueError(f"{dataset.prefix}: cannot decode its texts: {why}; leave 'texts' out of "
                                     "columns ('tokens' gives the token ids)")
                name = dataset.tokenizer["name_or_path"]
                self._tokenizers[dataset.prefix] = os.path.abspath(name) if os.path.isdir(name) else name
            counts = dataset.metadata["counts"]  # (a sharded dataset's too: its shards' in all)
            size = counts["image_bytes"] + counts["tokens"] * np.dtype(dataset.token_dtype).itemsize
            self._sizes.append((dataset.prefix, len(dataset), size))

    def estimate_inmemory_data_size(self) -> int:
        return sum(size for _, _, size in self._sizes)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        """About ``parallelism`` tasks in all, each over a contiguous range of one dataset's samples
        (each dataset gets tasks in proportion to its samples, at least one)."""
        total = sum(samples for _, samples, _ in self._sizes)
        schema = pa.schema([(name, COLUMNS[name]) for name in self.columns])
        tasks, columns, tokenizers = [], self.columns, self._tokenizers
        for prefix, samples, size in self._sizes:
            pieces = max(1, min(samples, round(max(1, parallelism) * samples / max(1, total))))
            bounds = np.linspace(0, samples, pieces + 1).astype(np.int64)
            for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
                if stop == start:
                    continue
                metadata = BlockMetadata(num_rows=stop - start, size_bytes=size * (stop - start) // max(1, samples),
                                         input_files=[prefix], exec_stats=None)
                tasks.append(ReadTask(lambda prefix=prefix, start=start, stop=stop: _read_range(
                    prefix, start, stop, columns, tokenizers[prefix]), metadata, schema, per_task_row_limit))
        return tasks


def read_mmidx(prefix_or_yaml: str | os.PathLike | Sequence[str | os.PathLike],
               columns: Sequence[str] = DEFAULT_COLUMNS, *, override_num_blocks: int | None = None,
               ray_remote_args: dict[str, Any] | None = None) -> Any:
    """A ``ray.data.Dataset`` of the samples of a dataset prefix, a list of them or a ``data.yaml``.

    One row per sample, in dataset order: ``dataset``, ``sample`` (its number), ``texts`` (decoded with
    the dataset's tokenizer), ``images`` (the stored bytes), ``image_sizes`` ([width, height] each),
    ``origin_file`` and ``origin_row`` (where it was built from) and ``extra`` (its JSON); ``tokens``
    (the token ids) on request. ``columns`` picks which, so a filter on sizes reads no image bytes.
    """
    source = MMIDXDatasource(dataset_prefixes(prefix_or_yaml), columns)
    return ray.data.read_datasource(source, override_num_blocks=override_num_blocks,
                                    ray_remote_args=ray_remote_args or {})
