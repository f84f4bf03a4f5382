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
from mmidx.dataset import MMIDXDataset, dataset_files, structure_problems
from mmidx.format import FormatError


def verify(prefix: str | os.PathLike) -> list[str]:
    """Every problem found in the dataset at ``prefix`` (an empty list means it is sound)."""
    try:
        dataset = MMIDXDataset(prefix)
    except FormatError as error:
        return [str(error)]
    return _verify_checksums(dataset) + structure_problems(dataset)


def _verify_checksums(dataset: MMIDXDataset) -> list[str]:
    problems = []
    for role, entry in (dataset.metadata or {}).get("files", {}).items():
        path = fmt.file_path(dataset.prefix, role)
        if fmt.sha256_file(path) != entry["sha256"]:
            problems.append(f"{path}: sha256 differs from the metadata: the file was modified or corrupted")
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
