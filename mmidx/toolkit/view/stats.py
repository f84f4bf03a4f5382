"""A dataset's overview: counts, the build report, and histograms, all from the index arrays.

Nothing here reads a token or an image: counts come from the metadata, tokens per sample from the
token index, image sizes from ``image_info`` (probed at build time), element kinds from the plan
records, read a part (shard) and a chunk at a time (:mod:`mmidx.read.statistics`), so the overview of
10^7 samples costs a few vectorised passes over arrays in memory bounded by the distinct values
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
from mmidx.read.checks import PlanTotals, counts_by_name, element_kind_counts, file_sizes, plan_totals
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.encoding_streams import describe, encoding_names
from mmidx.read.invariants import structure_problems
from mmidx.read.statistics import Distribution, chunks, sample_token_counts
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
    ranges of whole numbers (labelled ``lo–hi``)."""
    distribution = Distribution()
    distribution.add(values)
    return distribution_histogram(title, distribution, bars)


def distribution_histogram(title: str, distribution: Distribution, bars: int = MAX_BARS) -> Histogram:
    """:func:`integer_histogram` of the values a :class:`Distribution` counted (so streamed a chunk at a time)."""
    values, counts = distribution.values, distribution.counts
    if len(values) == 0:
        return Histogram(title, [], [], 0)
    low, high = int(values[0]), int(values[-1])
    width = max(1, math.ceil((high - low + 1) / bars))
    bar = (values - low) // width  # int64: the widest range of int64-held values of an index fits
    totals = np.zeros(int(bar[-1]) + 1, np.int64)
    np.add.at(totals, bar, counts)
    starts = low + width * np.arange(len(totals))
    labels = [f"{start:,}" if width == 1 else f"{start:,}–{start + width - 1:,}" for start in starts.tolist()]
    return Histogram(title, labels, totals.tolist(), distribution.count)


ASPECT_TITLE = "aspect ratio (width / height)"


def aspect_counts(widths: np.ndarray, heights: np.ndarray) -> np.ndarray:
    """The 35 bars' counts of :func:`aspect_histogram` (so they add up over chunks)."""
    with np.errstate(divide="ignore", invalid="ignore"):  # a width of 0 (a broken index) lands in the first bar
        steps = np.rint(np.nan_to_num(np.log2(widths.astype(np.float64) / np.maximum(heights, 1)) * 8,
                                      neginf=-17, posinf=17)).astype(np.int64)
    return np.bincount(np.clip(steps, -17, 17) + 17, minlength=35)


def aspect_bars(counts: np.ndarray) -> Histogram:
    """The aspect histogram of bars counted by :func:`aspect_counts`."""
    total = int(counts.sum())
    if total == 0:
        return Histogram(ASPECT_TITLE, [], [], 0)
    labels = [f"< {2 ** (-16.5 / 8):.2f}", *(f"{2 ** (k / 8):.2f}" for k in range(-16, 17)),
              f"> {2 ** (16.5 / 8):.2f}"]
    return Histogram(ASPECT_TITLE, labels, counts.tolist(), total)


def aspect_histogram(widths: np.ndarray, heights: np.ndarray) -> Histogram:
    """Counts of width/height in bars an eighth of an octave wide, centred on 1 (square), from 1:4 to 4:1;
    wider or taller images are counted in the two outer bars."""
    return aspect_bars(aspect_counts(np.asarray(widths), np.asarray(heights)))


def histograms(dataset: MMIDXDataset, plan: PlanTotals | None) -> list[Histogram]:
    """The overview's histograms of ``dataset`` (``plan``: its :func:`mmidx.read.checks.plan_totals`), one
    streaming pass over the token index and image_info of each part, a chunk at a time."""
    per_sample = Distribution()
    for part in dataset.parts:
        for chunk in sample_token_counts(part.dataset):
            per_sample.add(chunk)
    result = [distribution_histogram("tokens per sample", per_sample)]
    if plan is None:
        return result
    aspects = np.zeros(35, np.int64)
    for part in dataset.parts:
        for chunk in chunks(part.dataset.plan["image_info"]):
            aspects += aspect_counts(chunk["width"], chunk["height"])
    kinds = element_kind_counts(plan.kinds)
    result += [
        distribution_histogram("images per sample", plan.images_per_sample),
        distribution_histogram("image width (stored pixels)", plan.width),
        distribution_histogram("image height (stored pixels)", plan.height),
        aspect_bars(aspects),
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
    meta = dataset.metadata or {}
    sequences = tokens = 0
    for part in dataset.parts:
        sequences += part.dataset.tokens.sequence_count
        tokens += part.dataset.tokens.token_count
    info: dict[str, Any] = {
        "format_version": meta.get("format_version", "megatron"), "kind": dataset.kind,
        "token_dtype": dataset.token_dtype.name, "tokenizer": (dataset.tokenizer or {}).get("name_or_path"),
        "samples": len(dataset), "sequences": sequences, "tokens": tokens,
        "bytes": sum(file_sizes(dataset).values()), "build": meta.get("build") or {},
        "encodings": [describe(dataset, name) for name in encoding_names(dataset.prefix)],
    }
    try:
        plan = plan_totals(dataset, sizes=False)
        if plan is not None:
            info.update(views=plan.views, images=plan.images, element_kinds=element_kind_counts(plan.kinds),
                        formats=counts_by_name(fmt.IMAGE_FORMATS, plan.formats),
                        modes=counts_by_name(fmt.IMAGE_MODES, plan.modes))
        charts = histograms(dataset, plan)
    except IndexError as error:  # document indices out of range: the structure check says which invariant broke
        problems = structure_problems(dataset)
        raise FormatError(problems[0] if problems else f"{dataset.prefix}: {error}") from error
    info.update(report=build_report(dataset.prefix), histograms=charts)
    return info
