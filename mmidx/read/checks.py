"""Whole-dataset checks and statistics behind ``mmidx verify`` and ``mmidx inspect``.

Opening a dataset checks what can be checked in O(1). :func:`verify` does the rest: it recomputes
every file's checksum and the O(n) structural invariants, vectorised over the index arrays.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.images.decode import ImageError, probe, verify_decodable
from mmidx.io.storage import file_uri, hash_object, is_remote
from mmidx.read.dataset import MMIDXDataset, dataset_files
from mmidx.read.encoding_streams import describe, encoding_names, incomplete_encodings, stream_problems
from mmidx.read.invariants import content_problems, structure_problems


def verify(prefix: str | os.PathLike, *, decode: bool = False) -> list[str]:
    """Every problem found in the dataset at ``prefix`` (an empty list means it is sound).

    Recomputes every file's checksum, checks the O(n) structure (:func:`structure_problems`) and content
    (:func:`content_problems`) invariants readers and the packer enforce, and probes every stored image's
    header (format, width, height, mode, transparency) against ``image_info``; ``decode`` also decodes
    every image.
    """
    try:
        dataset = MMIDXDataset(prefix)
    except FormatError as error:
        return [str(error)]
    problems = _verify_checksums(dataset) + structure_problems(dataset)
    if not problems:  # these read with the offsets
        problems += content_problems(dataset)
    if dataset.plan is not None and not problems:
        problems += _verify_images(dataset, decode)
    for name in encoding_names(dataset.prefix):
        problems += stream_problems(dataset, name)
    problems += [f"{dataset.prefix}.enc.{name}.json: missing beside the encoding's .bin/.idx: an interrupted "
                 "precache or a deleted file; run `mmidx precache` again"
                 for name in incomplete_encodings(dataset.prefix)]
    return problems


def _verify_checksums(dataset: MMIDXDataset) -> list[str]:
    problems = []
    for role, entry in (dataset.metadata or {}).get("files", {}).items():
        remote = is_remote(dataset.prefix)
        path = file_uri(dataset.prefix, role) if remote else fmt.file_path(dataset.prefix, role)
        try:
            algorithm = fmt.file_hash_algorithm(entry)
            digest = hash_object(path, algorithm) if remote else fmt.hash_file(path, algorithm)
        except OSError as error:
            problems.append(f"{path}: cannot be read ({error.strerror})")
            continue
        if digest != entry[algorithm]:
            problems.append(f"{path}: {algorithm} checksum differs from the metadata: "
                            "the file was modified or corrupted")
    return problems


def _verify_images(dataset: MMIDXDataset, decode: bool) -> list[str]:
    plan, data, problems = dataset.plan, dataset.image_bytes, []
    offsets, info = plan["image_offsets"], plan["image_info"]
    check = verify_decodable if decode else probe
    remote, fetched_to = dataset.remote_files.get("images"), 0
    for number in range(len(info)):
        if remote is not None and number >= fetched_to:  # in storage: by windows of images, not a request each
            remote.release("verify")
            fetched_to = max(number + 1, int(np.searchsorted(offsets, offsets[number] + VERIFY_WINDOW, "right")) - 1)
            remote.fetch("verify", [(int(offsets[number]), int(offsets[fetched_to]))])
        where = f"{dataset.prefix}.images: image {number}"
        try:
            found = check(data[offsets[number]:offsets[number + 1]])
        except ImageError as error:
            problems.append(f"{where}: {error}")
            continue
        recorded = (int(info[number]["width"]), int(info[number]["height"]),
                    _name(fmt.IMAGE_FORMATS, info[number]["format"]), _name(fmt.IMAGE_MODES, info[number]["mode"]),
                    bool(info[number]["flags"] & fmt.IMAGE_FLAG_TRANSPARENCY))
        if (found.width, found.height, found.format, found.mode, found.has_transparency) != recorded:
            problems.append(f"{where} is a {found.width}x{found.height} {found.format} {found.mode} image "
                            f"{'with' if found.has_transparency else 'without'} transparency, but image_info in "
                            f"{dataset.prefix}.plan records {'x'.join(map(str, recorded[:2]))} {recorded[2]} "
                            f"{recorded[3]} {'with' if recorded[4] else 'without'} transparency")
        if len(problems) >= MAX_IMAGE_PROBLEMS:
            problems.append(f"{dataset.prefix}.images: stopped after {MAX_IMAGE_PROBLEMS} image problems")
            break
    if remote is not None:
        remote.release("verify")
    return problems


MAX_IMAGE_PROBLEMS = 20
VERIFY_WINDOW = 32 << 20  # bytes of a remote dataset's images fetched at once by verify


def file_sizes(dataset: MMIDXDataset) -> dict[str, int]:
    """File name -> bytes: on disk, or as the (checked) metadata records them for a remote dataset."""
    if is_remote(dataset.prefix):
        name = dataset.prefix.partition("?")[0].rsplit("/", 1)[-1]
        return {name + fmt.SUFFIXES[role]: entry["bytes"] for role, entry in dataset.metadata["files"].items()}
    return {path.name: path.stat().st_size for path in dataset_files(dataset.prefix)}


def _name(names: tuple[str, ...], code: int) -> str:
    return names[code] if code < len(names) else str(int(code))


def _stats(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"count": 0}
    values = np.asarray(values, dtype=np.float64)
    p50, p99 = np.percentile(values, [50, 99])  # one partition for both
    return {"count": len(values), "min": float(values.min()), "mean": round(float(values.mean()), 2),
            "p50": float(p50), "p99": float(p99), "max": float(values.max())}


def sample_token_counts(dataset: MMIDXDataset) -> np.ndarray:
    """Tokens of each sample (all its texts), int64, from the token index alone; needs a checked structure."""
    tokens = dataset.tokens
    cumulative = np.concatenate([[0], np.cumsum(tokens.sequence_lengths, dtype=np.int64)])
    return np.diff(cumulative[tokens.document_indices])


def counts_by_name(names: tuple[str, ...], codes: np.ndarray) -> dict[str, int]:
    """How many of ``codes`` each code names (codes beyond ``names`` by their number), without zeros."""
    counts = np.bincount(codes.astype(np.int64), minlength=len(names))
    return {_name(names, code): int(n) for code, n in enumerate(counts.tolist()) if n}


def element_kind_counts(elements: np.ndarray) -> dict[str, dict[str, int]]:
    """Per element kind: how many plan records have it, and how many of those have loss and enable_cfg."""
    flags = elements["flags"]
    # One bincount of kind·4 + loss + 2·cfg in uint8 (kinds are < 64 in a checked plan), not a copy per kind;
    # row k of the counts is kind k, its columns: neither flag, loss, cfg, both.
    loss, cfg = (flags & fmt.FLAG_LOSS) != 0, (flags & fmt.FLAG_ENABLE_CFG) != 0
    key = elements["kind"] * np.uint8(4) + loss + cfg * np.uint8(2)
    counts = np.bincount(key, minlength=4 * len(fmt.KIND_NAMES)).reshape(-1, 4)
    return {name: {"count": int(counts[code].sum()), "loss": int(counts[code, 1] + counts[code, 3]),
                   "enable_cfg": int(counts[code, 2] + counts[code, 3])} for code, name in enumerate(fmt.KIND_NAMES)}


def summary(dataset: MMIDXDataset) -> dict[str, Any]:
    """Counts, size statistics, element kinds, images and file sizes of a dataset, as plain data."""
    dataset.check_structure()  # the statistics index with the index arrays
    meta = dataset.metadata or {}
    tokens = dataset.tokens
    per_sample = sample_token_counts(dataset)
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
        "files": file_sizes(dataset),
    }
    plan = dataset.plan
    if plan is not None:
        info = plan["image_info"]
        result.update({
            "views": len(plan["view_element_offsets"]) - 1,
            "views_per_sample": _stats(np.diff(plan["sample_view_offsets"])),
            "elements_per_view": _stats(np.diff(plan["view_element_offsets"])),
            "element_kinds": element_kind_counts(plan["elements"]),
            "images": {
                "count": len(info),
                "bytes": _stats(np.diff(plan["image_offsets"])),
                "width": _stats(info["width"]),
                "height": _stats(info["height"]),
                "formats": counts_by_name(fmt.IMAGE_FORMATS, info["format"]),
                "modes": counts_by_name(fmt.IMAGE_MODES, info["mode"]),
            },
        })
    names = encoding_names(dataset.prefix)
    if names:
        result["encodings"] = [describe(dataset, name) for name in names]
    return result
