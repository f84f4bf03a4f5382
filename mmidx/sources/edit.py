"""``edit``: multi-step image editing in parquet, BAGEL's ``unified_edit``
(``data/interleave_datasets/edit_dataset.py``, ``parse_row``; ``_add_image``/``_add_text`` of
``interleave_t2i_dataset.py``).

Input: parquet files with ``image_list`` (list of encoded images, n ≥ 2) and ``instruction_list``
(n - 1 lists of alternative instructions; list k-1 edits image k-1 into image k).

Each of the K views is one of BAGEL's per-epoch draws, made with the same calls in the same order
on a ``random.Random`` seeded by (seed, file, row) (one generator per row, drawn view after view):

1. ``start = choice(range(n - 1))``; ``end = choice(range(start + 1, min(start + 3, n)))``;
2. start image: clean vae_image(enable_cfg=1) + vit_image(enable_cfg=1);
3. if ``end - start > 1 and random() < 0.5`` (``random()`` drawn only when the first holds):
   concat mode — if ``end == n - 1`` then ``end -= 1``; one text, each step's ``choice`` of options
   followed by ". ", joined and ``rstrip``-ed (enable_cfg=1, loss=0); then noised vae_image of
   ``end`` (loss=1, enable_cfg=0);
4. else sequential — per step k in start+1..end: text of ``choice(options)`` (enable_cfg=1,
   loss=0), noised vae_image of image k (loss=1, enable_cfg=0) and, except for the last step,
   clean vae_image(enable_cfg=1) + vit_image(enable_cfg=1) of image k.

Every image some view uses is stored once (in row order) and referenced by its clean-VAE,
noised-VAE and ViT elements; instructions are stored once each across all views. A row whose
instruction lists do not match its images (count, empty option lists, non-strings) is skipped,
where BAGEL would fail on some draws only; a row whose used images do not decode is skipped.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from mmidx.sources import Skip, Skipped, SourceContext, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.common import TextTable, assemble, samples_of
from mmidx.sources.elements import Element
from mmidx.sources.inputs import list_inputs, parquet_units, read_parquet
from mmidx.sources.media import ingest_image

KIND = "multimodal"
EXTENSIONS = (".parquet",)


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """Row-group ranges of the parquet inputs."""
    return parquet_units(list_inputs(inputs, EXTENSIONS), options.rows_per_shard)


def _condition(image: int) -> list[Element]:
    return [Element("vae_image", image, enable_cfg=True), Element("vit_image", image, enable_cfg=True)]


def draw_view(rng: random.Random, instructions: Sequence[Sequence[str]], table: TextTable) -> list[Element]:
    """One BAGEL ``parse_row`` draw as a plan; image payloads are positions in the row's image_list."""
    count = len(instructions) + 1
    start = rng.choice(range(count - 1))
    end = rng.choice(range(start + 1, min(start + 3, count)))
    view = _condition(start)
    if end - start > 1 and rng.random() < 0.5:
        if end == count - 1:
            end -= 1
        text = "".join(rng.choice(instructions[step - 1]) + ". " for step in range(start + 1, end + 1))
        view += [Element("text", table.add(text.rstrip()), enable_cfg=True), Element("vae_image", end, loss=True)]
        return view
    for step in range(start + 1, end + 1):
        view += [Element("text", table.add(rng.choice(instructions[step - 1])), enable_cfg=True),
                 Element("vae_image", step, loss=True)]
        if step != end:
            view += _condition(step)
    return view


def _check_row(images: object, instructions: object) -> None:
    if not isinstance(images, list) or not all(isinstance(image, bytes) for image in images):
        raise Skipped("malformed_record", "image_list is not a list of encoded images")
    if len(images) < 2:
        raise Skipped("instruction_image_mismatch", f"{len(images)} image(s); an edit needs at least 2")
    if (not isinstance(instructions, list) or len(instructions) != len(images) - 1
            or not all(isinstance(options, list) and options and all(isinstance(t, str) for t in options)
                       for options in instructions)):
        shape = [len(o) if isinstance(o, list) else type(o).__name__ for o in instructions] \
            if isinstance(instructions, list) else type(instructions).__name__
        raise Skipped("instruction_image_mismatch", f"{len(images)} images need {len(images) - 1} non-empty "
                                                    f"lists of instruction strings; got {shape}")


def _sample(unit: WorkUnit, row: int, record: dict, context: SourceContext) -> SourceSample:
    images, instructions = record["image_list"], record["instruction_list"]
    _check_row(images, instructions)
    rng, table = context.rng(unit.path, row), TextTable()
    views = [draw_view(rng, instructions, table) for _ in range(context.options.views)]
    return assemble(row, views, table.encode(context), lambda j: ingest_image(images[j], context))


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """One sample with K drawn views per row."""
    return samples_of(read_parquet(unit, ("image_list", "instruction_list")),
                      lambda row, record: _sample(unit, row, record, context))
