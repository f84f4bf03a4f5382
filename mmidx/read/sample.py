"""One sample of a dataset (:class:`Sample`), read from its mapped files, and a stored image (:class:`ImageRecord`).

A sample is a view of its dataset's maps: texts, images and each view's plan are zero-copy views, and every
file-derived index is checked before it is used. ``Sample.dataset`` is the
:class:`~mmidx.read.dataset.MMIDXDataset` of one set of files it belongs to (a sharded dataset's shard).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.read.invariants import decode_extra, element_problem


class ImageRecord(NamedTuple):
    """A stored image: its encoded bytes (zero-copy) and what was probed at build time."""

    data: memoryview
    width: int
    height: int
    format: str
    mode: str
    has_transparency: bool


class Sample:
    """One sample of a dataset: its texts and images (zero-copy views) and the plan of each view."""

    __slots__ = ("_dataset", "_files", "index")

    def __init__(self, dataset: Any, index: int, files: Any = None):
        self._dataset = dataset
        self._files = dataset._files if files is None else files  # the mapped files, without a property per read
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return Sample, (self._dataset, self.index)  # the dataset pickles as its prefix, the mapped files do not

    @property
    def dataset(self) -> Any:
        """The dataset the sample belongs to."""
        return self._dataset

    def __repr__(self) -> str:
        return (f"Sample({self.index}, views={self.num_views}, texts={self.num_texts}, "
                f"images={self.num_images})")

    def _range(self, name: str, number: int, limit: int) -> tuple[int, int]:
        """Entries ``number`` and ``number + 1`` of the offsets array ``name``, checked to be an
        ordered range inside ``[0, limit]`` before anything is read with them."""
        offsets = self._dataset.plan[name]
        start, end = int(offsets[number]), int(offsets[number + 1])
        if not 0 <= start <= end <= limit:
            raise FormatError(f"{self._dataset.prefix}.plan: {name}[{number}:{number + 2}] = [{start}, {end}] is "
                              f"not a range inside [0, {limit}] (sample {self.index}): corrupted")
        return start, end

    @property
    def num_texts(self) -> int:
        start, end = self._files.tokens.document_range(self.index)
        return end - start

    @property
    def num_images(self) -> int:
        table = self._files.image_table
        return 0 if table is None else table.count(self.index)

    @property
    def num_views(self) -> int:
        plan = self._dataset.plan
        if plan is None:
            return 1
        start, end = self._range("sample_view_offsets", self.index, len(plan["view_element_offsets"]) - 1)
        if start == end:
            raise FormatError(f"{self._dataset.prefix}.plan: sample {self.index} has no view: corrupted")
        return end - start

    def text(self, j: int) -> np.ndarray:
        """Token ids of the sample's text ``j`` (a read-only view of the mapped ``.bin``)."""
        return self._files.tokens.document_text(self.index, j)

    @property
    def texts(self) -> list[np.ndarray]:
        """Token ids of all the sample's texts."""
        return self._files.tokens.document_texts(self.index)

    def image(self, j: int) -> ImageRecord:
        """The sample's image ``j``: encoded bytes (a view of ``P.images``) and probed size, format, mode."""
        table = self._files.image_table
        if table is None:
            raise IndexError(f"image {j} out of range: sample {self.index} has 0 images")
        return table.image(self.index, j)

    def encoding(self, name: str, payload: int, img_num: int = 1) -> Any:
        """The precached encoding ``name`` of the sample's image (or text) ``payload``, as a zero-copy
        torch tensor: (C, h, w), or (2, C, h, w) moments (mean, log-variance), (h, w, D) tokens of a ViT
        stream (``--transform vit``), or (L, D) for a text ((n, D) from an encoder that read its string).
        A stream beside a dataset in object storage is read by byte range."""
        from mmidx.read.encoding_streams import open_stream

        stream = open_stream(self._dataset, name)
        if stream.meta["modality"] == "text":
            first, end = self._files.tokens.document_range(self.index)
            count, img_num = end - first, 0
        else:
            first, end = self._range("sample_image_offsets", self.index, len(self._dataset.plan["image_info"])) \
                if self._dataset.plan is not None else (0, 0)
            count = end - first
        if not 0 <= payload < count:
            raise IndexError(f"{name}: payload {payload} out of range: sample {self.index} has {count}")
        return stream.tensor(first + payload, img_num)

    @property
    def images(self) -> list[ImageRecord]:
        """All the sample's images."""
        return [self.image(j) for j in range(self.num_images)]

    def elements(self, view: int = 0) -> np.ndarray:
        """The plan of one view as ``ELEMENT_DTYPE`` records (a view of ``P.plan`` for multimodal data).

        Text datasets (and Megatron files) have one implied view: a text element with loss per sequence.
        """
        if not 0 <= view < self.num_views:
            raise IndexError(f"view {view} out of range: sample {self.index} has {self.num_views} views")
        plan = self._dataset.plan
        if plan is None:
            records = np.zeros(self.num_texts, dtype=fmt.ELEMENT_DTYPE)
            records["flags"] = fmt.FLAG_LOSS | fmt.FLAG_SPLIT_START | fmt.FLAG_SPLIT_END
            records["img_num"] = 1
            records["special_token_label"] = -1
            records["payload"] = np.arange(self.num_texts)
            return records
        number = int(plan["sample_view_offsets"][self.index]) + view  # checked by num_views
        start, end = self._range("view_element_offsets", number, len(plan["elements"]))
        records = plan["elements"][start:end]
        problem = element_problem(records, self.num_texts, self.num_images)
        if problem:
            raise FormatError(f"{self._dataset.prefix}.plan: view {view} of sample {self.index}: {problem}: corrupted")
        return records

    def sequence_plan(self, view: int = 0) -> list[dict[str, Any]]:
        """The plan of one view in BAGEL's ``sequence_plan`` shape (dicts), with each element's payload."""
        plan = []
        for record in self.elements(view):
            flags, label = int(record["flags"]), int(record["special_token_label"])
            item = {
                "type": fmt.KIND_NAMES[record["kind"]],
                "enable_cfg": int(bool(flags & fmt.FLAG_ENABLE_CFG)),
                "loss": int(bool(flags & fmt.FLAG_LOSS)),
                "special_token_loss": int(bool(flags & fmt.FLAG_SPECIAL_TOKEN_LOSS)),
                "special_token_label": None if label < 0 else label,
                "split_start": bool(flags & fmt.FLAG_SPLIT_START),
                "split_end": bool(flags & fmt.FLAG_SPLIT_END),
                "img_num": int(record["img_num"]),
                "payload": int(record["payload"]),
            }
            if flags & fmt.FLAG_HAS_FRAME_DELTA:
                item["frame_delta"] = int(record["frame_delta"])
            plan.append(item)
        return plan

    @property
    def extra(self) -> dict[str, Any]:
        """Per-sample JSON data the builder stored (e.g. an RL prompt's id and metadata); {} if none."""
        plan = self._dataset.plan
        if plan is None or "sample_extra" not in plan:
            return {}
        start, end = self._range("sample_extra_offsets", self.index, len(plan["sample_extra"]))
        if start == end:
            return {}
        extra, problem = decode_extra(plan["sample_extra"][start:end].tobytes())
        if problem:
            raise FormatError(f"{self._dataset.prefix}.plan: extra data of sample {self.index} is {problem}: "
                              "corrupted")
        return extra

    @property
    def origin(self) -> tuple[str | None, int]:
        """(input file, row) the sample was built from, when the builder recorded it."""
        plan = self._dataset.plan
        if plan is None:
            return None, -1
        source, row = (int(v) for v in plan["sample_origin"][self.index])
        sources = (self._dataset.metadata or {}).get("sources", [])
        return (sources[source] if 0 <= source < len(sources) else None), row
