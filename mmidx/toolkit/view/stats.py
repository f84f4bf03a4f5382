"""A dataset's overview: counts, the build report, and histograms, all from the index arrays.

Nothing here reads a token or an image: counts come from the metadata, tokens per sample from the
token index, image sizes from ``image_info`` (probed at build time), element kinds from the plan
records, so the overview of 10^7 samples costs a few vectorised passes over arrays
(``benchmarks/bench_view.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.ingest.report import report_path
from mmidx.io.storage import is_remote
from mmidx.read.checks import counts_by_name, element_kind_counts, file_sizes, sample_token_counts
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.encoding_streams import describe, encoding_names
from mmidx.read.invariants import structure_problems
from mmidx.sources import SKIP_REASONS, WARNING_REASONS

MAX_BARS = 40


@dataclass(frozen=True)
class Histogram:
    """Bars of a distribution: ``labels[i]`` names the range (or value) counted by ``counts[i]``."""

    title: str
    labels: list[str]
    counts: list[int]
    total: int


def integer_histogram(title: str, values: np.ndarray, bars: int = MAX_BARS) -> Histogram:
    """Counts of integer ``values``: one bar per value when the range is small, else ``bars`` equal
    ranges of whole numbers (labelled ``lo–hi``), by one ``bincount``."""
    values = np.asarray(values)
    if len(values) == 0:
        return Histogram(title, [], [], 0)
    low, high = int(values.min()), int(values.max())
    width = max(1, math.ceil((high - low + 1) / bars))
    if high - low >= 2**31 - 1:  # the offsets need 64 bits (else they are computed in the values' own type)
        values = values.astype(np.int64)
    offsets = values - values.dtype.type(low)
    counts = np.bincount(offsets // offsets.dtype.type(width) if width > 1 else offsets)
    starts = low + width * np.arange(len(counts))
    labels = [f"{start:,}" if width == 1 else f"{start:,}–{start + width - 1:,}" for start in starts.tolist()]
    return Histogram(title, labels, counts.tolist(), len(values))


def aspect_histogram(widths: np.ndarray, heights: np.ndarray) -> Histogram:
    """Counts of width/height in bars an eighth of an octave wide, centred on 1 (square), from 1:4 to 4:1;
    wider or taller images are counted in the two outer bars."""
    if len(widths) == 0:
        return Histogram("aspect ratio (width / height)", [], [], 0)
    with np.errstate(divide="ignore", invalid="ignore"):  # a width of 0 (a broken index) lands in the first bar
        steps = np.rint(np.nan_to_num(np.log2(widths.astype(np.float64) / np.maximum(heights, 1)) * 8,
                                      neginf=-17, posinf=17)).astype(np.int64)
    counts = np.bincount(np.clip(steps, -17, 17) + 17, minlength=35)
    labels = [f"< {2 ** (-16.5 / 8):.2f}", *(f"{2 ** (k / 8):.2f}" for k in range(-16, 17)),
              f"> {2 ** (16.5 / 8):.2f}"]
    return Histogram("aspect ratio (width / height)", labels, counts.tolist(), len(widths))


def histograms(dataset: MMIDXDataset, kinds: dict[str, dict[str, int]] | None) -> list[Histogram]:
    """The overview's histograms of ``dataset`` (``kinds``: its :func:`mmidx.read.checks.element_kind_counts`)."""
    result = [integer_histogram("tokens per sample", sample_token_counts(dataset))]
    plan = dataset.plan
    if plan is None or kinds is None:
        return result
    image_info = plan["image_info"]
    widths, heights = image_info["width"], image_info["height"]
    result += [
        integer_histogram("images per sample", np.diff(plan["sample_image_offsets"])),
        integer_histogram("image width (stored pixels)", widths),
        integer_histogram("image height (stored pixels)", heights),
        aspect_histogram(widths, heights),
        Histogram("element kinds (all views)", list(kinds), [k["count"] for k in kinds.values()],
                  sum(k["count"] for k in kinds.values())),
    ]
    return result


def build_report(prefix: str) -> dict[str, Any] | None:
    """The build report beside a local dataset (``PREFIX.report.json``), None when there is none; each
    skip and warning reason gets its description (the report's own, else mmidx's)."""
    if is_remote(prefix):
        return None
    path = report_path(prefix)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict):
        return None
    described = report.get("reasons") if isinstance(report.get("reasons"), dict) else {}
    for table, known in (("skips", SKIP_REASONS), ("warnings", WARNING_REASONS)):
        entries = report.get(table) if isinstance(report.get(table), dict) else {}
        report[table] = {reason: {**entry, "description": described.get(reason) or known.get(reason, "")}
                         for reason, entry in entries.items() if isinstance(entry, dict)}
    return report


def overview(dataset: MMIDXDataset) -> dict[str, Any]:
    """Everything the overview page shows of one dataset, as plain data.

    Counts are those the metadata records (checked against the files when the dataset was opened),
    so the cost is the histograms' passes over arrays; ``mmidx inspect``'s percentiles
    (:func:`mmidx.read.checks.summary`) are not computed here. Nothing is sized from a value of the
    arrays (every histogram has at most ``MAX_BARS`` bars, kinds and codes are bytes), so the O(n)
    structure check need not come first: the viewer runs it beside (:meth:`Catalog.structure`) and
    the page says its verdict. An index the histograms cannot follow is explained by that check."""
    meta, plan, tokens = dataset.metadata or {}, dataset.plan, dataset.tokens
    info: dict[str, Any] = {
        "format_version": meta.get("format_version", "megatron"), "kind": dataset.kind,
        "token_dtype": dataset.token_dtype.name, "tokenizer": (dataset.tokenizer or {}).get("name_or_path"),
        "samples": len(dataset), "sequences": tokens.sequence_count, "tokens": tokens.token_count,
        "bytes": sum(file_sizes(dataset).values()), "build": meta.get("build") or {},
        "encodings": [describe(dataset, name) for name in encoding_names(dataset.prefix)],
    }
    kinds = None
    if plan is not None:
        image_info, kinds = plan["image_info"], element_kind_counts(plan["elements"])
        info.update(views=len(plan["view_element_offsets"]) - 1, images=len(image_info), element_kinds=kinds,
                    formats=counts_by_name(fmt.IMAGE_FORMATS, image_info["format"]),
                    modes=counts_by_name(fmt.IMAGE_MODES, image_info["mode"]))
    try:
        charts = histograms(dataset, kinds)
    except IndexError as error:  # document indices out of range: the structure check says which invariant broke
        problems = structure_problems(dataset)
        raise FormatError(problems[0] if problems else f"{dataset.prefix}: {error}") from error
    info.update(report=build_report(dataset.prefix), histograms=charts)
    return info
