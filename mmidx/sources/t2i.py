"""``t2i``: text-to-image pairs in parquet, BAGEL's ``t2i_pretrain`` (``data/t2i_dataset.py``).

Input: parquet files with columns ``image`` (encoded bytes) and ``captions`` (a JSON string
``{"0": "...", "1": "...", ...}``). Rules, as BAGEL applies them:

* the image is decoded (``pil_img2rgb(Image.open(...))``); a row whose image fails is skipped;
* ``captions`` is parsed with ``json.loads``; a row whose captions are missing or do not parse is
  skipped (as must be a value that is not an object of strings, on which BAGEL would crash);
* every caption is tokenized with ``tokenizer.encode``; an empty object gives the single caption
  ``" "``; BAGEL picks ``random.choice`` of them per epoch.

mmidx stores every distinct caption once and the image once (with the object's keys, as the sample's extra
``caption_keys``, when they are not ``"0", "1", ...`` of distinct captions, so that ``mmidx export`` writes the
object back as it was), and materialises K views that pick
captions so that the first min(K, n) views show n distinct captions (a fresh shuffle per round,
seeded by (seed, file, row)). Plan of every view: text(caption, enable_cfg=1, loss=0) →
vae_image(loss=1, enable_cfg=0), the image referenced by its one noised-VAE element.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from mmidx.sources import Skip, Skipped, SourceContext, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.common import caption_sample, samples_of
from mmidx.sources.inputs import list_inputs, parquet_units, read_parquet
from mmidx.sources.media import ingest_image

KIND = "multimodal"
EXTENSIONS = (".parquet",)
CAPTION_KEYS = "caption_keys"  # the extra JSON key of a sample whose captions had other keys, or duplicates


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """Row-group ranges of the parquet inputs."""
    return parquet_units(list_inputs(inputs, EXTENSIONS), options.rows_per_shard)


def parse_captions(value: object) -> list[str]:
    """The captions of a ``captions`` cell (JSON object of strings), in the object's order."""
    return list(caption_object(value).values())


def caption_object(value: object) -> dict[str, str]:
    """A ``captions`` cell (JSON object of strings) as the object, keys in order."""
    if value is None:
        raise Skipped("bad_captions", "captions are null")
    try:
        captions = json.loads(value)
    except (TypeError, ValueError) as error:
        raise Skipped("bad_captions", f"captions are not JSON ({error}): {str(value)[:80]!r}") from error
    if not isinstance(captions, dict) or not all(isinstance(text, str) for text in captions.values()):
        raise Skipped("bad_captions", f"captions are not an object of strings: {str(value)[:80]!r}")
    return captions


def caption_keys(captions: dict[str, str]) -> list[list[Any]] | None:
    """What ``mmidx export`` needs to write ``captions`` back as they were, since the sample stores each distinct
    caption once: ``[key, number of its caption among the distinct ones]`` per key, in the object's order (a
    list: JSON objects may be stored with sorted keys); None when the object is BAGEL's plain
    ``{"0": ..., "1": ...}`` of distinct captions (nothing to record)."""
    distinct = list(dict.fromkeys(captions.values()))
    if list(captions) == [str(k) for k in range(len(distinct))] and len(distinct) == len(captions):
        return None
    return [[key, distinct.index(text)] for key, text in captions.items()]


def _sample(unit: WorkUnit, row: int, record: dict, context: SourceContext) -> SourceSample:
    if not isinstance(record["image"], bytes):
        raise Skipped("malformed_record", "image is null" if record["image"] is None else
                      f"image is {type(record['image']).__name__}, not bytes")
    image = ingest_image(record["image"], context)
    captions = caption_object(record["captions"])
    sample = caption_sample(row, list(captions.values()), image, context.rng(unit.path, row), context)
    keys = caption_keys(captions)
    sample.extra = None if keys is None else {CAPTION_KEYS: keys}
    return sample


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """One sample per row; rows with an unusable image or captions are skipped."""
    return samples_of(read_parquet(unit, ("image", "captions")), lambda row, record: _sample(unit, row, record,
                                                                                             context))
