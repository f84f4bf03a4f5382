"""What each sample becomes in an export's layouts, a row group at a time (run in the export's workers).

A row group's texts are decoded with the dataset's tokenizer in one batch call and tokenized back in another
(:class:`Texts`); a text used by the export that does not come back to the same ids is counted for its sample.
Each ``*_rows`` function turns one :class:`~mmidx.toolkit.export_plan.Group` into :class:`GroupRows`: the rows
the parent process writes (a ``pyarrow.Table``, tar members, JSONL lines and image files) and what the report
counts, each sample counted once per reason it will not round-trip.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from mmidx import format as fmt
from mmidx.read.dataset import MMIDXDataset, Sample
from mmidx.sources.t2i import CAPTION_KEYS
from mmidx.toolkit.export_plan import NO_SOURCE, Group
from mmidx.toolkit.sample import EXTENSIONS

TEXT_CHANGES = "a text does not tokenize back to the same ids"
NAME_CHANGES = "the file name changes, so each view's caption is drawn anew"
ROWS_SKIPPED = "rows were skipped at build time, so later rows' captions are drawn anew"
VIDEO_FRAMES = "a video row becomes a row of its stored frames (no frame deltas, one view)"

Text = Callable[[int], str]  # a sample's text number → the decoded text (counted when it does not round-trip)


class Texts:
    """The texts of ``samples`` (a row group's), decoded and tokenized back in one batch call each."""

    def __init__(self, tokenizer: Any, samples: list[Sample]):
        ids = [text.tolist() for sample in samples for text in sample.texts]
        decoded = tokenizer.decode_batch(ids)
        same = [back == original for back, original in zip(tokenizer.encode_batch(decoded), ids, strict=True)]
        self._texts: list[tuple[list[str], list[bool]]] = []
        first = 0
        for sample in samples:
            end = first + sample.num_texts
            self._texts.append((decoded[first:end], same[first:end]))
            first = end

    def of(self, position: int, notes: set[str]) -> Text:
        """The texts of the group's sample ``position``; one used that does not round-trip goes into ``notes``."""
        decoded, same = self._texts[position]

        def text(payload: int) -> str:
            if not same[payload]:
                notes.add(TEXT_CHANGES)
            return decoded[payload]
        return text


@dataclass
class GroupRows:
    """One row group as written: ``rows`` (the layout's), and what the report counts."""

    rows: Any = None
    samples: int = 0  # samples written (an edit row may not be)
    images: int = 0
    notes: Counter[str] = field(default_factory=Counter)  # reason → samples
    kept_name: int = 0  # samples whose source file has the output file's name (draws: ROWS_SKIPPED may apply)
    shifted: bool = False  # whether one of those is not at its source row (so ROWS_SKIPPED applies to them)

    def each(self, dataset: MMIDXDataset, tokenizer: Any, group: Group,
             draws: bool = False) -> Iterator[tuple[int, int, Sample, Text, set[str]]]:
        """(dataset number, row in the file, sample, its texts, its notes) of each sample of ``group``; the notes
        the loop's body adds are counted once the body is done. ``draws``: views draw captions by file name and
        row, so a sample whose file is renamed, or whose row moved, will draw anew (noted)."""
        numbers = list(group.samples())
        samples = [dataset[number] for number in numbers]
        texts = Texts(tokenizer, samples)
        for position, (number, sample) in enumerate(zip(numbers, samples, strict=True)):
            notes: set[str] = set()
            row = group.first_row + position
            if draws:
                source, origin_row = sample.origin
                if (os.path.basename(source) if source else NO_SOURCE) != group.name:
                    notes.add(NAME_CHANGES)
                else:
                    self.kept_name += 1
                    self.shifted |= origin_row != row
            yield number, row, sample, texts.of(position, notes), notes
            self.notes.update(notes)

    def written(self, sample: Sample) -> None:
        self.samples += 1
        self.images += sample.num_images


def caption_object(sample: Sample, captions: list[str]) -> dict[str, str]:
    """A t2i sample's captions as its row's JSON object: the keys and repeats the build recorded
    (:func:`mmidx.sources.t2i.caption_keys`), else BAGEL's ``{"0": ..., "1": ...}``."""
    keys = sample.extra.get(CAPTION_KEYS)
    if isinstance(keys, list) and all(isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int)
                                      and 0 <= pair[1] < len(captions) for pair in keys):
        return {str(key): captions[number] for key, number in keys}
    return {str(k): caption for k, caption in enumerate(captions)}


def captions(sample: Sample, text: Text) -> list[str]:
    """The sample's captions in stored order (t2i and wds store every distinct caption, in the row's order)."""
    return [text(j) for j in range(sample.num_texts)]


T2I_SCHEMA = pa.schema([("image", pa.binary()), ("captions", pa.string())])
EDIT_SCHEMA = pa.schema([("image_list", pa.list_(pa.binary())), ("instruction_list", pa.list_(pa.list_(pa.string())))])


def t2i_rows(dataset: MMIDXDataset, tokenizer: Any, group: Group) -> GroupRows:
    """BAGEL's t2i parquet rows: the stored image bytes and the captions' JSON object."""
    out, images, objects = GroupRows(), [], []
    for _, _, sample, text, _ in out.each(dataset, tokenizer, group, draws=True):
        images.append(bytes(sample.image(0).data))
        objects.append(json.dumps(caption_object(sample, captions(sample, text))))
        out.written(sample)
    out.rows = pa.table([pa.array(images, pa.binary()), pa.array(objects, pa.string())], schema=T2I_SCHEMA)
    return out


def wds_rows(dataset: MMIDXDataset, tokenizer: Any, group: Group) -> GroupRows:
    """WebDataset members (name, bytes): ``ROW.<ext>`` image, ``ROW.txt`` first caption, ``ROW.json`` second."""
    out, members = GroupRows(), []
    for _, row, sample, text, notes in out.each(dataset, tokenizer, group, draws=True):
        image, texts = sample.image(0), captions(sample, text)
        members += [(f"{row:08d}.{EXTENSIONS.get(image.format, 'bin')}", bytes(image.data)),
                    (f"{row:08d}.txt", texts[0].encode())]
        if len(texts) > 1:
            members.append((f"{row:08d}.json", json.dumps({"caption": texts[1]}).encode()))
        if len(texts) > 2:
            notes.add("more than two captions (a wds sample carries two)")
        out.written(sample)
    out.rows = members
    return out


def edit_instructions(sample: Sample, text: Text, notes: set[str]) -> list[list[str]] | None:
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
        spans, condition, drawn = [], None, None
        for record in sample.elements(view):
            kind, payload = int(record["kind"]), int(record["payload"])
            if kind == fmt.TEXT:
                drawn = text(payload)
            elif kind == fmt.VAE_IMAGE and not record["flags"] & fmt.FLAG_LOSS:
                condition = payload
            elif kind == fmt.VAE_IMAGE and condition is not None and drawn is not None:
                spans.append((condition, payload, drawn))
                drawn = None
        for first, last, drawn in spans:
            if last - first == 1 and len(spans) == 1:
                single.append((first, drawn))
                continue
            parts = [drawn] if last - first == 1 else drawn[:-1].split(". ") if drawn.endswith(".") else []
            if len(parts) == last - first:
                for step, part in zip(range(first, last), parts, strict=True):
                    options[step] += [] if part in options[step] else [part]
    seen = [list(step) for step in options]
    for step, drawn in single:
        combined = step == steps - 2 and drawn.endswith(".") and drawn not in seen[step]
        if combined and drawn[:-1] in seen[step]:
            continue
        if combined:
            notes.add("a one-step instruction ending in '.' may have gained it from a combined draw")
        options[step] += [] if drawn in options[step] else [drawn]
    return options if all(options) else None


def edit_rows(dataset: MMIDXDataset, tokenizer: Any, group: Group) -> GroupRows:
    """BAGEL's edit parquet rows (``image_list``, ``instruction_list``); a row with a step whose instruction
    cannot be recovered is not written (counted)."""
    out, image_lists, instruction_lists = GroupRows(), [], []
    for _, _, sample, text, notes in out.each(dataset, tokenizer, group):
        instructions = edit_instructions(sample, text, notes)
        if instructions is None:
            notes.add("an edit step's instruction is only inside an unsplittable combined one (row not written)")
            continue
        if any(len(step) > 1 for step in instructions):
            notes.add("a step has several instructions, so the rebuild draws anew")
        image_lists.append([bytes(image.data) for image in sample.images])
        instruction_lists.append(instructions)
        out.written(sample)
    out.rows = pa.table([pa.array(image_lists, EDIT_SCHEMA.field(0).type),
                         pa.array(instruction_lists, EDIT_SCHEMA.field(1).type)], schema=EDIT_SCHEMA)
    return out


def llava_conversation(sample: Sample, text: Text) -> list[dict]:
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
        value = text(int(record["payload"]))
        if record["flags"] & fmt.FLAG_LOSS:
            close()
            turns.append({"from": "gpt", "value": value})
        elif value != value.strip():  # only a turn without images keeps its text unstripped: a turn of its own
            close()
            turns.append({"from": "human", "value": value})
        else:
            if human and human[-1] != "<image>":
                close()  # two texts without an image between were two turns
            human.append(value)
    close()
    return turns


def listed_images(sample: Sample) -> list[int]:
    """The numbers of the stored images a conversation row lists, in order.

    img_num counts the row's listed images (BAGEL's resize rule divides by it), but only the used ones,
    always the first few, are stored: a used one is listed again in place of each unused one."""
    listed = max([int(e["img_num"]) for e in sample.elements(0) if e["kind"] == fmt.VIT_IMAGE] or [0])
    return list(range(sample.num_images)) + [0] * (listed - sample.num_images)


def llava_rows(dataset: MMIDXDataset, tokenizer: Any, group: Group) -> GroupRows:
    """LLaVA JSONL lines and their image files ``images/STEM_SAMPLE_J.<ext>`` (name, bytes)."""
    out, lines, files = GroupRows(), [], []
    stem = Path(group.name).stem
    for number, _, sample, text, notes in out.each(dataset, tokenizer, group):
        names = []
        for j, image in enumerate(sample.images):
            files.append((f"{stem}_{number:08d}_{j}.{EXTENSIONS.get(image.format, 'bin')}", bytes(image.data)))
            names.append(f"images/{files[-1][0]}")
        names = [names[j] for j in listed_images(sample)]
        if "video" in sample.extra:
            notes.add(VIDEO_FRAMES)
        record: dict[str, Any] = {"conversations": llava_conversation(sample, text)}
        if names:
            record["image"] = names[0] if len(names) == 1 else names
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        out.written(sample)
    out.rows = (lines, files)
    return out
