"""``mmidx export``: a dataset back to the raw layout it was built from, so leaving mmidx costs nothing.

Layouts (the source recorded in the metadata decides which apply):

=========  ====================  ==============================================================
source     ``--to``              written
=========  ====================  ==============================================================
t2i, wds   ``parquet``           BAGEL's t2i parquet: ``image`` (the stored bytes), ``captions``
                                 (JSON object ``{"0": caption, ...}``), one file per source file
t2i, wds   ``wds``               WebDataset tars: ``KEY.<ext>`` image, ``KEY.txt`` first caption,
                                 ``KEY.json`` ``{"caption": second caption}``
edit       ``parquet``           BAGEL's edit parquet (``image_list``, ``instruction_list``) and
                                 ``parquet_info.json`` (row groups per file, as BAGEL reads it)
vlm        ``jsonl``             LLaVA JSONL (``conversations``, ``image``) and ``images/`` files
t2i, wds,  ``hf``                a ``datasets`` folder for ``load_from_disk``: :mod:`mmidx.toolkit.export_hf`
vlm, hf
=========  ====================  ==============================================================

Texts are decoded with the dataset's tokenizer; a text that does not tokenize back to the same ids
is counted. Image bytes are the stored ones: the original bytes unless the build re-encoded them
(``--max-image-size``) or decoded video frames.

Samples of source files of one name (``part.parquet`` of two folders) go to one file, in dataset order.

An export streams: each file is written a row group at a time as the groups fill
(:mod:`mmidx.toolkit.export_plan`: at most 1,024 samples, ending once it holds 16 MiB of images and text), never
a whole file held, and the groups' rows are made on ``workers`` processes or Ray actors
(:mod:`mmidx.toolkit.export_workers`) while this process writes them in their order. So its memory is bounded
whatever the dataset's size (a few groups per worker in flight), and its files are the same bytes at any worker
count; a sharded dataset gives the files its merge would.

What rebuilding an export gives (``mmidx build`` with the same source, tokenizer, seed and views):

* t2i/wds → same layout: the same samples, bit for bit, when the files keep their names (they do)
  and no row of a source file was skipped at build time: views draw captions with a generator
  keyed by (seed, file name, row), and a skipped row shifts the rows after it. Across layouts
  (t2i → wds, wds → parquet) file names change, so texts and images are the same but the caption
  each view shows is drawn anew. wds carries two captions per sample; more are counted and lost.
* vlm image and text rows: the same samples (one view, nothing is drawn). Video rows are written
  as multi-image rows of their stored frames: no frame deltas, one view (counted).
* edit: mmidx stores only the images and instructions some view drew, so the export holds those;
  an instruction drawn only inside a combined ("a. b.") instruction is recovered by splitting it
  (a one-step combined draw, "a.", is told from an option "a." by the other views, else counted).
  The rebuild draws its views anew from what is left: the same samples when every step had one
  instruction and every image was drawn, otherwise new draws (rows with an unrecoverable step are
  not written, and counted).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mmidx.read.dataset import MMIDXDataset
from mmidx.toolkit.export_plan import ROWS, ExportPlan
from mmidx.toolkit.export_rows import (
    EDIT_SCHEMA,
    ROWS_SKIPPED,
    T2I_SCHEMA,
    GroupRows,
    edit_rows,
    llava_rows,
    t2i_rows,
    wds_rows,
)
from mmidx.toolkit.export_workers import Workers, ordered_results
from mmidx.toolkit.sample import dataset_tokenizer

PROGRESS_DELAY = 2.0  # seconds before the progress bar shows (a small export prints none)
LAYOUTS = {"t2i": ("parquet", "wds"), "wds": ("parquet", "wds"), "edit": ("parquet",), "vlm": ("jsonl",)}


@dataclass
class ExportReport:
    """What an export wrote, and what will not come back the same from a rebuild."""

    output: str
    layout: str
    samples: int = 0
    images: int = 0
    files: list[str] = field(default_factory=list)
    lossy: dict[str, int] = field(default_factory=dict)  # what will not round-trip → samples affected

    def count(self, what: str, samples: int) -> None:
        """``samples`` more samples will not come back the same from a rebuild, because of ``what``."""
        if samples:
            self.lossy[what] = self.lossy.get(what, 0) + samples

    def add(self, rows: GroupRows) -> None:
        """Count a row group's samples, images and notes."""
        self.samples += rows.samples
        self.images += rows.images
        for what, samples in rows.notes.items():
            self.count(what, samples)

    def summary(self) -> str:
        files = len(self.files)
        lines = [f"{self.output}: {self.samples:,} sample{'s' if self.samples != 1 else ''} as {self.layout}, "
                 f"{self.images:,} image{'s' if self.images != 1 else ''}, {files} file{'s' if files != 1 else ''}"]
        lines += [f"  not round-trip: {what}: {count:,} sample{'s' if count != 1 else ''}"
                  for what, count in self.lossy.items()]
        return "\n".join(lines)


def tokenizer_of(dataset: MMIDXDataset) -> Any:
    """The dataset's recorded tokenizer, loaded; a ValueError saying why when its texts cannot be decoded."""
    tokenizer, why = dataset_tokenizer(dataset)
    if tokenizer is None:
        raise ValueError(f"{dataset.prefix}: cannot decode its texts: {why}")
    return tokenizer


@dataclass(frozen=True)
class RowsJob:
    """The workers' job (:mod:`mmidx.toolkit.export_workers`): ``rows(dataset, tokenizer, group, *options)``
    of each row group, the dataset at ``prefix`` opened once per worker."""

    prefix: str
    tokenizer: Any
    rows: Callable[..., Any]
    options: tuple[Any, ...] = ()

    def open(self) -> MMIDXDataset:
        return MMIDXDataset(self.prefix)

    def run(self, dataset: MMIDXDataset, group: Any) -> Any:
        return self.rows(dataset, self.tokenizer, group, *self.options)


class FileWriter(Protocol):
    def write(self, rows: Any) -> None:
        """Append one row group's rows."""

    def close(self) -> Any:
        """Finish the file; what the layout records of it (or None)."""


def write_groups(plan: ExportPlan, job: RowsJob, open_file: Callable[[Path], FileWriter], out: Path,
                 report: ExportReport, run: Workers, progress: bool) -> list[tuple[Path, Any]]:
    """Write every row group of ``plan`` into folder ``out``, each file opened with ``open_file(path)`` at its first
    group and closed after its last, counting into ``report``; (path, what ``close`` returned) of each file."""
    from tqdm import tqdm

    writing: dict[int, tuple[Path, FileWriter]] = {}
    kept, shifted, closed = Counter(), set(), []
    bar = tqdm(total=len(plan.dataset), unit=" samples", unit_scale=True, delay=PROGRESS_DELAY, file=sys.stderr,
               disable=not progress, dynamic_ncols=True, desc=f"export → {out.name.removesuffix('.partial')}")
    try:
        for group, rows in ordered_results(job, plan.groups(), run):
            if group.file not in writing:
                writing[group.file] = (out / group.name, open_file(out / group.name))
            writing[group.file][1].write(rows.rows)
            report.add(rows)
            kept[group.file] += rows.kept_name
            if rows.shifted:
                shifted.add(group.file)
            if group.last:
                path, writer = writing.pop(group.file)
                closed.append((path, writer.close()))
                report.files.append(str(path))
                if group.file in shifted:
                    report.count(ROWS_SKIPPED, kept[group.file])
            bar.update(group.size)
    finally:
        for _, writer in writing.values():  # an export that failed: its folder is removed
            writer.close()
        bar.close()
    return closed


class ParquetFile:
    """A parquet file written a row group at a time (one per :func:`write`)."""

    def __init__(self, path: Path, schema: Any):
        import pyarrow.parquet as pq

        self.writer = pq.ParquetWriter(path, schema)

    def write(self, rows: Any) -> None:
        if rows.num_rows:
            self.writer.write_table(rows, row_group_size=ROWS)

    def close(self) -> None:
        self.writer.close()


class _TarFile:
    def __init__(self, path: Path):
        self.archive = tarfile.open(path, "w")

    def write(self, members: list[tuple[str, bytes]]) -> None:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            self.archive.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        self.archive.close()


class _JsonlFile:
    def __init__(self, path: Path):
        self.stream, self.images = open(path, "w", encoding="utf-8"), path.parent / "images"

    def write(self, rows: tuple[list[str], list[tuple[str, bytes]]]) -> None:
        lines, files = rows
        for name, data in files:
            (self.images / name).write_bytes(data)
        self.stream.writelines(lines)

    def close(self) -> None:
        self.stream.close()


def parquet_name(source: str) -> str:
    return Path(source).stem + ".parquet"


def _tar_name(source: str) -> str:
    return source.split(".", 1)[0] + ".tar"


def _jsonl_name(source: str) -> str:
    return Path(source).stem + ".jsonl"


# (source, layout) → (a source file's name → its output file's, rows of a group, a file's writer)
WRITERS: dict[tuple[str, str], tuple[Callable[[str], str], Callable[..., GroupRows], Callable[[Path], FileWriter]]] = {
    ("t2i", "parquet"): (parquet_name, t2i_rows, lambda path: ParquetFile(path, T2I_SCHEMA)),
    ("t2i", "wds"): (_tar_name, wds_rows, _TarFile),
    ("edit", "parquet"): (parquet_name, edit_rows, lambda path: ParquetFile(path, EDIT_SCHEMA)),
    ("vlm", "jsonl"): (_jsonl_name, llava_rows, _JsonlFile),
}
WRITERS["wds", "parquet"], WRITERS["wds", "wds"] = WRITERS["t2i", "parquet"], WRITERS["t2i", "wds"]


def export(prefix: str | os.PathLike, layout: str, output: str | os.PathLike, *, workers: int = 1,
           engine: str = "local", ray_address: str | None = None, progress: bool = False) -> ExportReport:
    """Write the dataset at ``prefix`` to folder ``output`` in ``layout`` (see the module docstring), its row
    groups made on ``workers`` processes (``engine="ray"``: Ray actors, on the cluster at ``ray_address``), with
    a progress bar on stderr if ``progress``.

    The files are written under ``output + ".partial"`` and renamed into place when complete, so an
    interrupted export leaves no folder that looks finished.
    """
    run = Workers(workers, engine, ray_address)
    dataset = MMIDXDataset(prefix)
    source = ((dataset.metadata or {}).get("build") or {}).get("source")
    if source not in LAYOUTS:
        raise ValueError(f"{dataset.prefix}: built by the {source or 'unknown'} source; export writes datasets "
                         f"built by {', '.join(sorted(LAYOUTS))}")
    if layout not in LAYOUTS[source]:
        raise ValueError(f"{dataset.prefix}: a {source} dataset exports --to {' or '.join(LAYOUTS[source])}, "
                         f"not {layout}")
    name_of, rows, open_file = WRITERS[source, layout]
    job = RowsJob(dataset.prefix, tokenizer_of(dataset), rows)

    def write(out: Path, report: ExportReport) -> None:
        if layout == "jsonl":
            (out / "images").mkdir()
        closed = write_groups(ExportPlan(dataset, name_of), job, open_file, out, report, run, progress)
        if source == "edit":
            _write_parquet_info(out, [path for path, _ in closed], report)

    report = write_folder(output, layout, write)
    if layout == "parquet" and source == "edit":
        report.files.append(str(Path(output) / "parquet_info.json"))
    return report


def _write_parquet_info(out: Path, paths: list[Path], report: ExportReport) -> None:
    """BAGEL's ``parquet_info.json``: each file's row groups and rows, by its path once in place."""
    import pyarrow.parquet as pq

    info = {}
    for path in paths:
        metadata = pq.ParquetFile(path).metadata
        info[str((Path(report.output) / path.name).resolve())] = {"num_row_groups": metadata.num_row_groups,
                                                                 "num_rows": metadata.num_rows}
    (out / "parquet_info.json").write_text(json.dumps(info, indent=1))


def write_folder(output: str | os.PathLike, layout: str, write: Callable[[Path, ExportReport], None]) -> ExportReport:
    """Run ``write(folder, report)`` into ``output + ".partial"`` and rename it to ``output`` when it returns, so
    an interrupted export leaves no folder that looks finished; ``output`` must not hold files already."""
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty folder; choose a new one")
    partial = Path(f"{out}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    report = ExportReport(str(out), layout)
    try:
        write(partial, report)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    partial.rename(out)
    report.files = [str(out / Path(path).relative_to(partial)) for path in report.files]
    return report
