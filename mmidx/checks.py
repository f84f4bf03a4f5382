"""Whole-dataset checks and statistics behind ``mmidx verify`` and ``mmidx inspect``.

Opening a dataset checks what can be checked in O(1). :func:`verify` does the rest: it recomputes
every file's checksum and the O(n) structural invariants, vectorised over the index arrays.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx.dataset import MMIDXDataset, dataset_files
from mmidx.format import FormatError


def verify(prefix: str | os.PathLike) -> list[str]:
    """Every problem found in the dataset at ``prefix`` (an empty list means it is sound)."""
    try:
        dataset = MMIDXDataset(prefix)
    except FormatError as error:
        return [str(error)]
    problems = _verify_checksums(dataset) + _verify_token_index(dataset)
    if dataset.plan is not None:
        problems += _verify_plan(dataset)
    return problems


def _verify_checksums(dataset: MMIDXDataset) -> list[str]:
    problems = []
    for role, entry in (dataset.metadata or {}).get("files", {}).items():
        path = fmt.file_path(dataset.prefix, role)
        if fmt.sha256_file(path) != entry["sha256"]:
            problems.append(f"{path}: sha256 differs from the metadata: the file was modified or corrupted")
    return problems


def _verify_token_index(dataset: MMIDXDataset) -> list[str]:
    tokens, problems = dataset.tokens, []
    lengths = tokens.sequence_lengths
    where = f"{dataset.prefix}.idx"
    if np.any(lengths < 0):
        problems.append(f"{where}: {int(np.sum(lengths < 0))} negative sequence lengths")
    if not np.array_equal(tokens.sequence_pointers, fmt.sequence_pointers(lengths, tokens.dtype.itemsize)):
        problems.append(f"{where}: sequence pointers are not the cumulative sequence lengths")
    if np.any(np.diff(tokens.document_indices) < 0):
        problems.append(f"{where}: document indices decrease")
    return problems


def _verify_plan(dataset: MMIDXDataset) -> list[str]:
    plan, problems = dataset.plan, []
    where = f"{dataset.prefix}.plan"
    for name in ("sample_view_offsets", "sample_image_offsets", "view_element_offsets", "image_offsets",
                 "sample_extra_offsets"):
        if name in plan and np.any(np.diff(plan[name]) < 0):
            problems.append(f"{where}: {name} decrease")
    if problems:
        return problems  # the per-element checks below index with these offsets
    elements = plan["elements"]
    if np.any(elements["kind"] >= len(fmt.KIND_NAMES)):
        problems.append(f"{where}: unknown element kinds {sorted(set(elements['kind'][elements['kind'] > 2]))}")
    if np.any(elements["flags"] > fmt.KNOWN_FLAGS):  # the known flags are the low bits
        problems.append(f"{where}: elements with unknown flag bits")
    if np.any(elements["img_num"] < 1):
        problems.append(f"{where}: elements with img_num 0")
    sample_of_element = dataset.element_samples()
    texts = np.diff(dataset.tokens.document_indices)[sample_of_element]
    images = np.diff(plan["sample_image_offsets"])[sample_of_element]
    limit = np.where(elements["kind"] == fmt.TEXT, texts, images)
    bad = (elements["payload"] < 0) | (elements["payload"] >= limit)
    if np.any(bad):
        problems.append(f"{where}: {int(bad.sum())} elements name a text or image their sample does not have "
                        f"(first: element {int(np.argmax(bad))})")
    info = plan["image_info"]
    if np.any((info["width"] <= 0) | (info["height"] <= 0)):
        problems.append(f"{where}: images with a non-positive width or height")
    if np.any(info["format"] >= len(fmt.IMAGE_FORMATS)) or np.any(info["mode"] >= len(fmt.IMAGE_MODES)):
        problems.append(f"{where}: images with unknown format or mode codes")
    sources = len((dataset.metadata or {}).get("sources", []))
    origin = plan["sample_origin"][:, 0]
    if np.any((origin < -1) | (origin >= sources)):
        problems.append(f"{where}: samples whose origin names none of the {sources} recorded sources")
    return problems


def _stats(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"count": 0}
    values = np.asarray(values, dtype=np.float64)
    return {"count": len(values), "min": float(values.min()), "mean": round(float(values.mean()), 2),
            "p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
            "max": float(values.max())}


def summary(dataset: MMIDXDataset) -> dict[str, Any]:
    """Counts, size statistics, element kinds, images and file sizes of a dataset, as plain data."""
    meta = dataset.metadata or {}
    tokens = dataset.tokens
    cumulative = np.concatenate([[0], np.cumsum(tokens.sequence_lengths, dtype=np.int64)])
    per_sample = np.diff(cumulative[tokens.document_indices])
    result: dict[str, Any] = {
        "prefix": dataset.prefix,
        "format_version": meta.get("format_version", "megatron"),
        "kind": dataset.kind,
        "token_dtype": dataset.token_dtype.name,
        "tokenizer": (dataset.tokenizer or {}).get("name_or_path"),
        "samples": len(dataset),
        "sequences": tokens.sequence_count,
        "tokens": int(tokens.sequence_lengths.sum(dtype=np.int64)),
        "tokens_per_sequence": _stats(tokens.sequence_lengths),
        "tokens_per_sample": _stats(per_sample),
        "files": {path.name: path.stat().st_size for path in dataset_files(dataset.prefix)},
    }
    plan = dataset.plan
    if plan is not None:
        elements = plan["elements"]
        kinds = {}
        for code, name in enumerate(fmt.KIND_NAMES):
            selected = elements[elements["kind"] == code]
            kinds[name] = {"count": len(selected),
                           "loss": int(np.count_nonzero(selected["flags"] & fmt.FLAG_LOSS)),
                           "enable_cfg": int(np.count_nonzero(selected["flags"] & fmt.FLAG_ENABLE_CFG))}
        info = plan["image_info"]
        result.update({
            "views": len(plan["view_element_offsets"]) - 1,
            "views_per_sample": _stats(np.diff(plan["sample_view_offsets"])),
            "elements_per_view": _stats(np.diff(plan["view_element_offsets"])),
            "element_kinds": kinds,
            "images": {
                "count": len(info),
                "bytes": _stats(np.diff(plan["image_offsets"])),
                "width": _stats(info["width"]),
                "height": _stats(info["height"]),
                "formats": {fmt.IMAGE_FORMATS[c] if c < len(fmt.IMAGE_FORMATS) else str(c): n
                            for c, n in sorted(Counter(info["format"].tolist()).items())},
                "modes": {fmt.IMAGE_MODES[c] if c < len(fmt.IMAGE_MODES) else str(c): n
                          for c, n in sorted(Counter(info["mode"].tolist()).items())},
            },
        })
    return result
