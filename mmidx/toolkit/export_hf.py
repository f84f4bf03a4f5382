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
report, as for the other layouts. Needs ``datasets`` (``pip install "mmidx[hf]"``) for the features. It streams
and runs on workers as the other layouts do (:mod:`mmidx.toolkit.export`), after a first pass over the samples'
extra JSON for its keys (every file has one set of columns).
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
from mmidx.toolkit.export import ExportReport, RowsJob, tokenizer_of, write_folder, write_groups
from mmidx.toolkit.export_plan import ExportPlan, Group
from mmidx.toolkit.export_rows import (
    VIDEO_FRAMES,
    GroupRows,
    Text,
    caption_object,
    captions,
    listed_images,
    llava_conversation,
)
from mmidx.toolkit.export_workers import Workers, ordered_results

T2I_SOURCES = ("t2i", "wds")
CONVERSATION_SOURCES = ("vlm",)
RESERVED = ("conversations", "images", "image", "captions", "origin_file", "origin_row")  # columns written here


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
    """One Arrow stream file written a row group at a time; its schema (and features) come from the first group."""

    def __init__(self, path: Path, datasets: Any, image_columns: dict[str, bool]):
        self.path, self._datasets, self._image_columns = path, datasets, image_columns
        self._writer: Any = None
        self._schema_written: pa.Schema | None = None
        self.features: dict[str, Any] | None = None

    def _schema(self, table: pa.Table) -> pa.Schema:
        features = self._datasets.Features.from_arrow_schema(table.schema)
        for name, is_list in self._image_columns.items():
            image = self._datasets.Image()
            features[name] = self._datasets.List(image) if is_list else image
        self.features = features.to_dict()
        schema = features.arrow_schema
        return schema.with_metadata({"huggingface": json.dumps({"info": {"features": self.features}})})

    def write(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        if self._writer is None:
            self._schema_written = self._schema(table)
            self._writer = pa.ipc.new_stream(str(self.path), self._schema_written)
        try:
            table = table.select(self._schema_written.names).cast(self._schema_written)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError) as error:
            raise ValueError(f"{self.path.name}: the samples' extra JSON changes type between rows ({error}); "
                             "an Arrow column holds one type") from error
        self._writer.write_table(table)

    def close(self) -> dict[str, Any] | None:
        """Finish the file; its features."""
        if self._writer is not None:
            self._writer.close()
        return self.features


def _image(data: memoryview) -> dict[str, Any]:
    return {"bytes": bytes(data), "path": None}


def _row(sample: Sample, conversation: bool, text: Text) -> dict[str, Any]:
    if conversation:
        row: dict[str, Any] = {"conversations": llava_conversation(sample, text),
                               "images": [_image(sample.image(j).data) for j in listed_images(sample)]}
    else:
        row = {"image": _image(sample.image(0).data), "captions": list(caption_object(sample,
                                                                                      captions(sample, text)).values())}
    source, origin_row = sample.origin
    return {**row, "origin_file": source, "origin_row": origin_row, **_extra(sample)}


def _extra(sample: Sample) -> dict[str, Any]:
    """The sample's extra JSON as columns, less what the export itself used (a t2i row's caption keys)."""
    return {key: value for key, value in sample.extra.items() if key != CAPTION_KEYS}


def hf_rows(dataset: MMIDXDataset, tokenizer: Any, group: Group, conversation: bool,
            extra_keys: tuple[str, ...]) -> GroupRows:
    """A row group of the ``datasets`` columns (module docstring) as a table; absent extra keys are null."""
    out, rows = GroupRows(), []
    for _, _, sample, text, notes in out.each(dataset, tokenizer, group, draws=not conversation):
        if "video" in sample.extra:
            notes.add(VIDEO_FRAMES)
        rows.append({**_row(sample, conversation, text), **{key: None for key in extra_keys
                                                            if key not in sample.extra}})
        out.written(sample)
    out.rows = pa.Table.from_pylist(rows)
    return out


def extra_keys(dataset: MMIDXDataset, tokenizer: Any, group: Group) -> set[str]:
    """The keys of the group's samples' extra JSON that become columns."""
    return {key for number in group.samples() for key in _extra(dataset[number])}


def _hf_name(source: str) -> str:
    return Path(source).stem + ".arrow"


def _write(dataset: MMIDXDataset, out: Path, report: ExportReport, run: Workers, progress: bool) -> None:
    datasets = import_extra("datasets", "hf", "mmidx export --to hf")
    conversation = _conversation_rows(dataset)
    tokenizer = tokenizer_of(dataset)
    plan = ExportPlan(dataset, _hf_name)
    keys: set[str] = set()
    for _, found in ordered_results(RowsJob(dataset.prefix, None, extra_keys), plan.groups(), run):
        keys |= found
    reserved = set(RESERVED) & keys
    if reserved:
        raise ValueError(f"{dataset.prefix}: the samples' extra JSON has keys {sorted(reserved)}, which --to hf "
                         "writes itself")
    job = RowsJob(dataset.prefix, tokenizer, hf_rows, (conversation, tuple(sorted(keys))))
    columns = {"images": True} if conversation else {"image": False}
    files, features = [], None
    for path, found in write_groups(plan, job, lambda path: _ArrowFile(path, datasets, columns), out, report, run,
                                    progress):
        if features not in (None, found):
            raise ValueError(f"{dataset.prefix}: {path.name} has other columns than the files before it "
                             f"({found} vs {features}); a datasets folder has one set of features")
        features = found
        files.append(path.name)
    _write_json(out / "dataset_info.json", {"citation": "", "description": "", "features": features or {},
                                           "homepage": "", "license": ""})
    fingerprint = hashlib.sha256(json.dumps([files, features]).encode()).hexdigest()[:16]
    _write_json(out / "state.json", {"_data_files": [{"filename": name} for name in files],
                                     "_fingerprint": fingerprint, "_format_columns": None, "_format_kwargs": {},
                                     "_format_type": None, "_output_all_columns": False, "_split": None})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2))


def export_hf(prefix: str | os.PathLike, output: str | os.PathLike, *, workers: int = 1, engine: str = "local",
              ray_address: str | None = None, progress: bool = False) -> ExportReport:
    """Write the dataset at ``prefix`` to folder ``output`` as a ``datasets`` folder (see the module docstring), on
    workers as :func:`mmidx.toolkit.export.export` does."""
    run = Workers(workers, engine, ray_address)
    dataset = MMIDXDataset(prefix)
    _conversation_rows(dataset)  # refuse other sources before anything is written
    report = write_folder(output, "hf", lambda partial, report: _write(dataset, partial, report, run, progress))
    report.files += [str(Path(output) / "dataset_info.json"), str(Path(output) / "state.json")]
    return report
