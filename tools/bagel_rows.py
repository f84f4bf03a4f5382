"""BAGEL's own per-row code making the sample of an mmidx (sample, view), its random draws answering mmidx's: what
tools/check_bagel.py packs with BAGEL's ``pack_sequence``. Call ``bagel_peer.import_bagel`` first."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from functools import cache
from typing import Any
from unittest import mock

from mmidx.errors import MMIDXError
from mmidx.read.dataset import Sample
from mmidx.sources import SourceContext, SourceOptions


class NotBagels(MMIDXError):
    """BAGEL's code could not make the sample mmidx packed (a draw mmidx made is not among BAGEL's options, or
    BAGEL's loop skipped the row): reported as a mismatch of the pack."""


@cache
def row_groups(path: str) -> list[int]:
    """Cumulative row counts of a parquet file's row groups (BAGEL reads a row as (row group, row in it))."""
    import pyarrow.parquet as pq

    metadata, total, ends = pq.ParquetFile(path).metadata, 0, []
    for group in range(metadata.num_row_groups):
        total += metadata.row_group(group).num_rows
        ends.append(total)
    return ends


def locate(path: str, row: int) -> tuple[int, int]:
    """(row group, row inside it) of ``row`` of a parquet file."""
    start = 0
    for group, end in enumerate(row_groups(path)):
        if row < end:
            return group, row - start
        start = end
    raise NotBagels(f"row {row} is past the end of {path}")


def first_yield(dataset: Any) -> dict[str, Any]:
    try:
        return next(iter(dataset))
    except StopIteration as stop:
        raise NotBagels("BAGEL's loop yielded nothing") from stop


class BagelSamples:
    """BAGEL's own per-row code, making the sample of an mmidx (sample, view) from its raw file and row."""

    def __init__(self, packed: Any, groups: list[str]):
        import data.interleave_datasets.edit_dataset as edit_module
        import data.t2i_dataset as t2i_module
        import data.video_utils as video_module
        import data.vlm_dataset as vlm_module

        self.datasets = dict(zip(groups, packed.grouped_datasets, strict=True))
        self.t2i_module, self.edit_module, self.vlm_module = t2i_module, edit_module, vlm_module
        self.video_module = video_module
        self.videos = 0  # video samples made, their frame draws mmidx's

    def make(self, group: str, sample: Sample, view: int, seed: int) -> dict[str, Any]:
        path, row = sample.origin
        if path is None:
            raise NotBagels("mmidx recorded no origin for the sample")
        dataset = self.datasets[group]
        if group == "t2i_pretrain":
            return self._t2i(dataset, sample, view, path, row)
        if group == "unified_edit":
            return self._edit(dataset, view, path, row, seed)
        return self._vlm(dataset, sample, view, path, row)

    def _vlm(self, dataset: Any, sample: Sample, view: int, path: str, row: int) -> dict[str, Any]:
        with open(path, encoding="utf-8") as stream:
            line = stream.readlines()[row]
        dataset.data_paths_per_rank, dataset.data_status = [(line, dataset.data_paths[0][1])], None

        def skipped(*args: Any, **kwargs: Any) -> None:  # BAGEL's loop would skip the row and repeat forever
            raise NotBagels(f"BAGEL skipped line {row} of {path}: {' '.join(map(str, args)) or sys.exc_info()[1]!r}")

        def message(*args: Any, **kwargs: Any) -> None:
            if args and str(args[0]).startswith("No loss"):
                skipped(*args)

        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(self.vlm_module, "traceback", types.SimpleNamespace(
                print_exc=skipped)))
            stack.enter_context(mock.patch.object(self.vlm_module, "print", message))
            if (sample.extra or {}).get("video_frames") is not None:
                stack.enter_context(self._frames(sample, view))
                self.videos += 1
            return first_yield(dataset)

    @contextlib.contextmanager
    def _frames(self, sample: Sample, view: int) -> Iterator[None]:
        """BAGEL's ``FrameSampler`` draws (``np.random.randint`` frame count, ``random.choice`` frame per
        interval) answering the frames of mmidx's view."""
        numbers = sample.extra["video_frames"]
        frames = [numbers[item["payload"]] for item in sample.sequence_plan(view) if item["type"] == "vit_image"]
        chosen = iter(frames)

        def choice(interval: range) -> int:
            frame = next(chosen, None)
            if frame not in interval:
                raise NotBagels(f"mmidx's frame {frame} of view {view} is outside BAGEL's interval {interval}")
            return frame

        def permutation(count: int) -> Any:
            raise NotBagels(f"BAGEL's frame intervals are empty for {count} frames (its fallback permutation)")

        numpy = self.video_module.np

        class NumpyDrawingMmidxs:  # numpy, but for the two draws
            random = types.SimpleNamespace(randint=lambda low, high: len(frames), permutation=permutation)

            def __getattr__(self, name: str) -> Any:
                return getattr(numpy, name)

        with mock.patch.object(self.video_module, "np", NumpyDrawingMmidxs()), \
                mock.patch.object(self.video_module, "random", types.SimpleNamespace(choice=choice)):
            yield

    def _t2i(self, dataset: Any, sample: Sample, view: int, path: str, row: int) -> dict[str, Any]:
        text = next(item["payload"] for item in sample.sequence_plan(view) if item["type"] == "text")
        caption = sample.text(text).tolist()

        def choice(options: list[list[int]]) -> list[int]:  # BAGEL's random.choice of the captions' tokens
            if caption not in options:
                raise NotBagels(f"mmidx's caption of view {view} is not among BAGEL's {len(options)} captions")
            return caption

        group_index, in_group = locate(path, row)
        dataset.data_paths_per_rank, dataset.data_status = [path], [[0, group_index, in_group - 1]]
        with mock.patch.object(self.t2i_module, "random", types.SimpleNamespace(choice=choice)):
            made = first_yield(dataset)
        if made["data_indexes"]["data_indexes"] != [0, group_index, in_group]:
            raise NotBagels(f"BAGEL skipped row {row} of {path}")
        return made

    def _edit(self, dataset: Any, view: int, path: str, row: int, seed: int) -> dict[str, Any]:
        group_index, in_group = locate(path, row)
        dataset.data_paths_per_rank, dataset.data_status = [(path, group_index)], [[0, in_group - 1]]
        draws = SourceContext(None, SourceOptions(seed=seed)).rng(path, row)  # mmidx's generator of this row
        with mock.patch.object(self.edit_module, "random", draws):
            for _ in range(view + 1):  # view v is the (v+1)-th parse_row draw from the row's generator
                made = first_yield(dataset)
        if made["data_indexes"]["data_indexes"] != [0, in_group]:
            raise NotBagels(f"BAGEL skipped row {row} of {path}")
        return made
