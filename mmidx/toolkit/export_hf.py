"""``mmidx export --to hf``: a dataset as a Hugging Face ``datasets`` folder that ``datasets.load_from_disk`` opens.

The folder is ``Dataset.save_to_disk``'s layout — Arrow stream files, ``state.json`` listing them in order,
``dataset_info.json`` with the features — written with pyarrow, one Arrow file per source file of the build
(named after it: ``data-00000-of-00001.arrow`` stays ``data-00000-of-00001.arrow``), so that building the
export again with ``mmidx build --source hf`` draws the same views. Columns:

* t2i-shaped datasets (sources ``t2i``, ``wds``, and ``hf`` with t2i rows): ``image`` (an ``Image`` feature
  holding the stored bytes: the original ones unless the build re-encoded them), ``captions`` (the sample's
  distinct captions, in the row's order: ``--caption-column captions`` gives them back);
* conversation datasets (``vlm``, and ``hf`` with ``conversations``): ``conversations`` (LLaVA turns whose
  ``change_format`` gives back the view, as ``--to jsonl`` writes them) and ``images`` (a list of ``Image``);
* always ``origin_file`` and ``origin_row`` (where the sample was built from), and one column per key of
  the samples' extra JSON (the ``--keep-columns`` of an hf build; absent keys are null).

Round trip: ``hf → mmidx → hf → mmidx`` writes the same ``bin``, ``idx``, ``images`` and ``plan`` files
when the first build skipped no row of a file and the rebuild names the same caption and kept columns (the
metadata differs only by the input paths it records). What will not come back the same is counted in the
report, as for the other layouts. Needs ``datasets`` (``pip install "mmidx[hf]"``) for the features.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from mmidx import format as fmt
from mmidx.errors import import_extra
from mmidx.read.dataset import MMIDXDataset, Sample
from mmidx.sources.t2i import CAPTION_KEYS
from mmidx.toolkit.export import (
    ExportReport,
    Texts,
    by_source_file,
    caption_object,
    listed_images,
    llava_conversation,
    note_draws,
    write_folder,
)

T2I_SOURCES = ("t2i", "wds")
CONVERSATION_SOURCES = ("vlm",)
BATCH_ROWS = 256  # rows per record batch (an Arrow file is written batch by batch)


def _conversation_rows(dataset: MMIDXDataset) -> bool:
    """Whether the dataset's samples are conversations (ViT images) rather than t2i pairs (a noised VAE image)."""
    source = ((dataset.metadata or {}).get("build") or {}).get("source")
    if source in T2I_SOURCES + CONVERSATION_SOURCES:
        return source in CONVERSATION_SOURCES
    if source != "hf":
        raise ValueError(f"{dataset.prefix}: built by the {source or 'unknown'} source; --to hf writes datasets built "
                         f"by {', '.join(sorted(T2I_SOURCES + CONVERSATION_SOURCES + ('hf',)))}")
    return len(dataset) > 0 and not any(dataset[0].elements(0)["kind"] == fmt.VAE_IMAGE)


class _ArrowFile:
    """One Arrow stream file written batch by batch; its schema (and features) come from the first batch."""

    def __init__(self, path: Path, datasets: Any, image_columns: dict[str, bool]):
        self.path, self._datasets, self._image_columns = path, datasets, image_columns
        self._rows: list[dict[str, Any]] = []
        self._writer: Any = None
        self._schema_written: pa.Schema | None = None
        self.features: dict[str, Any] | None = None

    def add(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        if len(self._rows) >= BATCH_ROWS:
            self._flush()

    def _schema(self, table: pa.Table) -> pa.Schema:
        features = self._datasets.Features.from_arrow_schema(table.schema)
        for name, is_list in self._image_columns.items():
            image = self._datasets.Image()
            features[name] = self._datasets.List(image) if is_list else image
        self.features = features.to_dict()
        schema = features.arrow_schema
        return schema.with_metadata({"huggingface": json.dumps({"info": {"features": self.features}})})

    def _flush(self) -> None:
        if not self._rows:
            return
        table = pa.Table.from_pylist(self._rows)
        if self._writer is None:
            self._schema_written = self._schema(table)
            self._writer = pa.ipc.new_stream(str(self.path), self._schema_written)
        try:
            table = table.select(self._schema_written.names).cast(self._schema_written)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError) as error:
            raise ValueError(f"{self.path.name}: the samples' extra JSON changes type between rows ({error}); "
                             "an Arrow column holds one type") from error
        self._writer.write_table(table)
        self._rows = []

    def close(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()


def _image(data: memoryview) -> dict[str, Any]:
    return {"bytes": bytes(data), "path": None}


def _row(sample: Sample, conversation: bool, texts: Texts, report: ExportReport) -> dict[str, Any]:
    if conversation:
        row: dict[str, Any] = {"conversations": llava_conversation(sample, texts, report),
                               "images": [_image(sample.image(j).data) for j in listed_images(sample)]}
    else:
        captions = caption_object(sample, [texts(sample, j, report) for j in range(sample.num_texts)])
        row = {"image": _image(sample.image(0).data), "captions": list(captions.values())}
    source, origin_row = sample.origin
    return {**row, "origin_file": source, "origin_row": origin_row, **_extra(sample)}


def _extra(sample: Sample) -> dict[str, Any]:
    """The sample's extra JSON as columns, less what the export itself used (a t2i row's caption keys)."""
    return {key: value for key, value in sample.extra.items() if key != CAPTION_KEYS}


def _write(dataset: MMIDXDataset, out: Path, report: ExportReport) -> None:
    datasets = import_extra("datasets", "hf", "mmidx export --to hf")
    conversation = _conversation_rows(dataset)
    texts = Texts(dataset)
    extra_keys = sorted({key for index in range(len(dataset)) for key in _extra(dataset[index])})
    reserved = {"conversations", "images", "image", "captions", "origin_file", "origin_row"} & set(extra_keys)
    if reserved:
        raise ValueError(f"{dataset.prefix}: the samples' extra JSON has keys {sorted(reserved)}, which --to hf "
                         "writes itself")
    files, features = [], None
    for name, indices in by_source_file(dataset).items():
        arrow = _ArrowFile(out / (Path(name).stem + ".arrow"), datasets, {"images": True} if conversation
                           else {"image": False})
        for index in indices:
            sample = dataset[index]
            if "video" in sample.extra:
                report.note("a video row becomes a row of its stored frames (no frame deltas, one view)", index)
            arrow.add({**_row(sample, conversation, texts, report), **{key: None for key in extra_keys
                                                                          if key not in sample.extra}})
            report.samples += 1
            report.images += sample.num_images
        arrow.close()
        if features not in (None, arrow.features):
            raise ValueError(f"{dataset.prefix}: {arrow.path.name} has other columns than the files before it "
                             f"({arrow.features} vs {features}); a datasets folder has one set of features")
        features = arrow.features
        if not conversation:
            note_draws(dataset, indices, name.endswith(".arrow"), report)
        files.append(arrow.path.name)
        report.files.append(str(arrow.path))
    _write_json(out / "dataset_info.json", {"citation": "", "description": "", "features": features or {},
                                           "homepage": "", "license": ""})
    fingerprint = hashlib.sha256(json.dumps([files, features]).encode()).hexdigest()[:16]
    _write_json(out / "state.json", {"_data_files": [{"filename": name} for name in files],
                                     "_fingerprint": fingerprint, "_format_columns": None, "_format_kwargs": {},
                                     "_format_type": None, "_output_all_columns": False, "_split": None})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2))


def export_hf(prefix: str | os.PathLike, output: str | os.PathLike) -> ExportReport:
    """Write the dataset at ``prefix`` to folder ``output`` as a ``datasets`` folder (see the module docstring)."""
    dataset = MMIDXDataset(prefix)
    _conversation_rows(dataset)  # refuse other sources before anything is written
    report = write_folder(output, "hf", lambda partial, report: _write(dataset, partial, report))
    report.files += [str(Path(output) / "dataset_info.json"), str(Path(output) / "state.json")]
    return report
