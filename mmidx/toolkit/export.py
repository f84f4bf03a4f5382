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
import tarfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmidx import format as fmt
from mmidx.read.dataset import MMIDXDataset, Sample
from mmidx.sources.t2i import CAPTION_KEYS
from mmidx.toolkit.sample import EXTENSIONS, dataset_tokenizer

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
    affected: dict[str, set[int]] = field(default_factory=dict, repr=False)

    def note(self, what: str, sample: int) -> None:
        """Sample number ``sample`` will not come back the same from a rebuild, because of ``what``."""
        self.affected.setdefault(what, set()).add(sample)
        self.lossy[what] = len(self.affected[what])

    def summary(self) -> str:
        files = len(self.files)
        lines = [f"{self.output}: {self.samples:,} sample{'s' if self.samples != 1 else ''} as {self.layout}, "
                 f"{self.images:,} image{'s' if self.images != 1 else ''}, {files} file{'s' if files != 1 else ''}"]
        lines += [f"  not round-trip: {what}: {count:,} sample{'s' if count != 1 else ''}"
                  for what, count in self.lossy.items()]
        return "\n".join(lines)


class Texts:
    """Token ids → text with the dataset's tokenizer, counting texts that do not tokenize back the same."""

    def __init__(self, dataset: MMIDXDataset):
        self.tokenizer, why = dataset_tokenizer(dataset)
        if self.tokenizer is None:
            raise ValueError(f"{dataset.prefix}: cannot decode its texts: {why}")

    def __call__(self, sample: Sample, payload: int, report: ExportReport) -> str:
        ids = sample.text(payload).tolist()
        text = self.tokenizer.decode(ids)
        if self.tokenizer.encode(text) != ids:
            report.note("a text does not tokenize back to the same ids", sample.index)
        return text


def by_source_file(dataset: MMIDXDataset) -> dict[str, list[int]]:
    """Sample numbers grouped by the source file they came from, in dataset order."""
    groups: dict[str, list[int]] = defaultdict(list)
    for index in range(len(dataset)):
        source, _ = dataset[index].origin
        groups[os.path.basename(source) if source else "samples"].append(index)
    return groups


def _rows_shifted(dataset: MMIDXDataset, indices: list[int]) -> bool:
    return any(dataset[index].origin[1] != row for row, index in enumerate(indices))


def _captions(sample: Sample, texts: Texts, report: ExportReport) -> list[str]:
    """The sample's captions in stored order (t2i and wds store every distinct caption, in the row's order)."""
    return [texts(sample, j, report) for j in range(sample.num_texts)]


def caption_object(sample: Sample, captions: list[str]) -> dict[str, str]:
    """A t2i sample's captions as its row's JSON object: the keys and repeats the build recorded
    (:func:`mmidx.sources.t2i.caption_keys`), else BAGEL's ``{"0": ..., "1": ...}``."""
    keys = sample.extra.get(CAPTION_KEYS)
    if isinstance(keys, list) and all(isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int)
                                      and 0 <= pair[1] < len(captions) for pair in keys):
        return {str(key): captions[number] for key, number in keys}
    return {str(k): caption for k, caption in enumerate(captions)}


def _write_t2i_parquet(dataset: MMIDXDataset, out: Path, texts: Texts, report: ExportReport) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, indices in by_source_file(dataset).items():
        images, captions = [], []
        for index in indices:
            sample = dataset[index]
            images.append(bytes(sample.image(0).data))
            captions.append(json.dumps(caption_object(sample, _captions(sample, texts, report))))
            report.samples += 1
            report.images += 1
        note_draws(dataset, indices, name.endswith(".parquet"), report)
        path = out / (Path(name).stem + ".parquet")
        pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "captions": pa.array(captions, pa.string())}),
                       path)
        report.files.append(str(path))


def note_draws(dataset: MMIDXDataset, indices: list[int], same_name: bool, report: ExportReport) -> None:
    if not same_name:
        for index in indices:
            report.note("the file name changes, so each view's caption is drawn anew", index)
    elif _rows_shifted(dataset, indices):
        for index in indices:
            report.note("rows were skipped at build time, so later rows' captions are drawn anew", index)


def _write_wds(dataset: MMIDXDataset, out: Path, texts: Texts, report: ExportReport) -> None:
    for name, indices in by_source_file(dataset).items():
        path = out / (name.split(".", 1)[0] + ".tar")
        with tarfile.open(path, "w") as archive:
            for row, index in enumerate(indices):
                sample = dataset[index]
                image = sample.image(0)
                captions = _captions(sample, texts, report)
                members = [(EXTENSIONS.get(image.format, "bin"), bytes(image.data)), ("txt", captions[0].encode())]
                if len(captions) > 1:
                    members.append(("json", json.dumps({"caption": captions[1]}).encode()))
                if len(captions) > 2:
                    report.note("more than two captions (a wds sample carries two)", index)
                for extension, data in members:
                    info = tarfile.TarInfo(f"{row:08d}.{extension}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
                report.samples += 1
                report.images += 1
        note_draws(dataset, indices, name.endswith(".tar"), report)
        report.files.append(str(path))


def _edit_row(sample: Sample, texts: Texts, report: ExportReport) -> list[list[str]] | None:
    """The instruction options of each step recovered from the sample's views; None if a step has none.

    A view is (condition image, text, noised image) once per step. Several steps in one view are
    sequential (texts are options as drawn); one text spanning several steps is a combined draw
    ("o1. o2.": each option + ". ", joined, rstripped). One text over one step is either: a combined
    draw adds a "." and can only run from image n-3 to n-2, so a text ending in "." there whose
    other form was not seen elsewhere is kept as drawn and counted as ambiguous.
    """
    steps = sample.num_images - 1
    options: list[list[str]] = [[] for _ in range(steps)]
    single: list[tuple[int, str]] = []  # (step, text) of one-step views, resolved once all views are read
    for view in range(sample.num_views):
        spans, condition, text = [], None, None
        for record in sample.elements(view):
            kind, payload = int(record["kind"]), int(record["payload"])
            if kind == fmt.TEXT:
                text = texts(sample, payload, report)
            elif kind == fmt.VAE_IMAGE and not record["flags"] & fmt.FLAG_LOSS:
                condition = payload
            elif kind == fmt.VAE_IMAGE and condition is not None and text is not None:
                spans.append((condition, payload, text))
                text = None
        for first, last, text in spans:
            if last - first == 1 and len(spans) == 1:
                single.append((first, text))
                continue
            parts = [text] if last - first == 1 else text[:-1].split(". ") if text.endswith(".") else []
            if len(parts) == last - first:
                for step, part in zip(range(first, last), parts, strict=True):
                    options[step] += [] if part in options[step] else [part]
    seen = [list(step) for step in options]
    for step, text in single:
        combined = step == steps - 2 and text.endswith(".") and text not in seen[step]
        if combined and text[:-1] in seen[step]:
            continue
        if combined:
            report.note("a one-step instruction ending in '.' may have gained it from a combined draw",
                        sample.index)
        options[step] += [] if text in options[step] else [text]
    return options if all(options) else None


def _write_edit_parquet(dataset: MMIDXDataset, out: Path, texts: Texts, report: ExportReport) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    info = {}
    for name, indices in by_source_file(dataset).items():
        image_lists, instruction_lists = [], []
        for index in indices:
            sample = dataset[index]
            instructions = _edit_row(sample, texts, report)
            if instructions is None:
                report.note("an edit step's instruction is only inside an unsplittable combined one (row not written)",
                            index)
                continue
            if any(len(step) > 1 for step in instructions):
                report.note("a step has several instructions, so the rebuild draws anew", index)
            image_lists.append([bytes(image.data) for image in sample.images])
            instruction_lists.append(instructions)
            report.samples += 1
            report.images += sample.num_images
        path = out / (Path(name).stem + ".parquet")
        pq.write_table(pa.table({"image_list": pa.array(image_lists, pa.list_(pa.binary())),
                                 "instruction_list": pa.array(instruction_lists, pa.list_(pa.list_(pa.string())))}),
                       path)
        metadata = pq.ParquetFile(path).metadata
        info[str((Path(report.output) / path.name).resolve())] = {"num_row_groups": metadata.num_row_groups,
                                                                 "num_rows": metadata.num_rows}
        report.files.append(str(path))
    (out / "parquet_info.json").write_text(json.dumps(info, indent=1))


def llava_conversation(sample: Sample, texts: Texts, report: ExportReport) -> list[dict]:
    """LLaVA turns whose ``change_format`` gives back the view's elements: gpt turns are the texts with loss;
    a run of other elements is one human turn, ``<image>`` where a ViT image stood."""
    turns: list[dict[str, Any]] = []
    human: list[str] = []  # pieces of the open human turn ("<image>" or a text)

    def close() -> None:
        if human:
            turns.append({"from": "human", "value": "".join(human)})
            human.clear()

    for record in sample.elements(0):
        if record["kind"] == fmt.VIT_IMAGE:
            human.append("<image>")
            continue
        text = texts(sample, int(record["payload"]), report)
        if record["flags"] & fmt.FLAG_LOSS:
            close()
            turns.append({"from": "gpt", "value": text})
        elif text != text.strip():  # only a turn without images keeps its text unstripped: a turn of its own
            close()
            turns.append({"from": "human", "value": text})
        else:
            if human and human[-1] != "<image>":
                close()  # two texts without an image between were two turns
            human.append(text)
    close()
    return turns


def listed_images(sample: Sample) -> list[int]:
    """The numbers of the stored images a conversation row lists, in order.

    img_num counts the row's listed images (BAGEL's resize rule divides by it), but only the used ones,
    always the first few, are stored: a used one is listed again in place of each unused one."""
    listed = max([int(e["img_num"]) for e in sample.elements(0) if e["kind"] == fmt.VIT_IMAGE] or [0])
    return list(range(sample.num_images)) + [0] * (listed - sample.num_images)


def _write_llava_jsonl(dataset: MMIDXDataset, out: Path, texts: Texts, report: ExportReport) -> None:
    folder = out / "images"
    folder.mkdir()
    for name, indices in by_source_file(dataset).items():
        path = out / (Path(name).stem + ".jsonl")
        with open(path, "w", encoding="utf-8") as stream:
            for index in indices:
                sample = dataset[index]
                names = []
                for j, image in enumerate(sample.images):
                    file = f"{Path(name).stem}_{index:08d}_{j}.{EXTENSIONS.get(image.format, 'bin')}"
                    (folder / file).write_bytes(image.data)
                    names.append(f"images/{file}")
                names = [names[j] for j in listed_images(sample)]
                if "video" in sample.extra:
                    report.note("a video row becomes a row of its stored frames (no frame deltas, one view)", index)
                record: dict[str, Any] = {"conversations": llava_conversation(sample, texts, report)}
                if names:
                    record["image"] = names[0] if len(names) == 1 else names
                stream.write(json.dumps(record, ensure_ascii=False) + "\n")
                report.samples += 1
                report.images += sample.num_images
        report.files.append(str(path))


WRITERS: dict[tuple[str, str], Callable[[MMIDXDataset, Path, Texts, ExportReport], None]] = {
    ("t2i", "parquet"): _write_t2i_parquet, ("wds", "parquet"): _write_t2i_parquet,
    ("t2i", "wds"): _write_wds, ("wds", "wds"): _write_wds,
    ("edit", "parquet"): _write_edit_parquet, ("vlm", "jsonl"): _write_llava_jsonl,
}


def export(prefix: str | os.PathLike, layout: str, output: str | os.PathLike) -> ExportReport:
    """Write the dataset at ``prefix`` to folder ``output`` in ``layout`` (see the module docstring).

    The files are written under ``output + ".partial"`` and renamed into place when complete, so an
    interrupted export leaves no folder that looks finished.
    """
    dataset = MMIDXDataset(prefix)
    source = ((dataset.metadata or {}).get("build") or {}).get("source")
    if source not in LAYOUTS:
        raise ValueError(f"{dataset.prefix}: built by the {source or 'unknown'} source; export writes datasets "
                         f"built by {', '.join(sorted(LAYOUTS))}")
    if layout not in LAYOUTS[source]:
        raise ValueError(f"{dataset.prefix}: a {source} dataset exports --to {' or '.join(LAYOUTS[source])}, "
                         f"not {layout}")
    texts = Texts(dataset)
    report = write_folder(output, layout, lambda partial, report: WRITERS[source, layout](dataset, partial, texts,
                                                                                         report))
    if layout == "parquet" and source == "edit":
        report.files.append(str(Path(output) / "parquet_info.json"))
    return report


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
