"""Whole-dataset checks and statistics behind ``mmidx verify`` and ``mmidx inspect``.

Opening a dataset checks what can be checked in O(1). :func:`verify` does the rest: it recomputes
every file's checksum and the O(n) structural invariants, vectorised over the index arrays.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.images.decode import ImageError, probe, verify_decodable
from mmidx.io.cache_folder import cache_settings
from mmidx.io.remote_file import RemoteFile
from mmidx.io.small_files import cached_small_files, small_file_copy
from mmidx.io.storage import cache_root, file_uri, hash_object, is_remote
from mmidx.read.dataset import MMIDXDataset, dataset_files
from mmidx.read.encoding_streams import describe, encoding_names, incomplete_encodings, stream_problems
from mmidx.read.invariants import content_problems, structure_problems
from mmidx.read.statistics import Distribution, add_bincount, chunks, differences, sample_token_counts


def verify(prefix: str | os.PathLike, *, decode: bool = False, copies: list[str] | None = None) -> list[str]:
    """Every problem found in the dataset at ``prefix`` (an empty list means it is sound).

    Recomputes every file's checksum, checks the O(n) structure (:func:`structure_problems`) and content
    (:func:`content_problems`) invariants readers and the packer enforce, and probes every stored image's
    header (format, width, height, mode, transparency) against ``image_info``; ``decode`` also decodes
    every image. Of a remote dataset, the objects in storage and this node's copies of its small files, which its
    readers map (a copy found damaged is a problem, and downloaded again); offline (``cache_offline``), the
    copies and the data cache's blocks alone. ``copies``: where to list the local copies hashed.
    """
    damaged: list[str] = []
    try:
        if is_remote(prefix):  # the copies as they are, before an open would replace a damaged one
            settings = cache_settings()
            cached_small_files(os.fspath(prefix), settings.folder, offline=settings.offline, damaged=damaged)
        dataset = MMIDXDataset(prefix)
    except FormatError as error:
        return [f"{problem}: fetched again" for problem in damaged] + [str(error)]
    problems = [f"{problem}: fetched again, and checked" for problem in damaged]
    problems += _verify_checksums(dataset, [] if copies is None else copies) + structure_problems(dataset)
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


def _verify_checksums(dataset: MMIDXDataset, copies: list[str]) -> list[str]:
    """The files whose checksum differs from the metadata's: local files; of a remote dataset, its objects in
    storage (offline: the data files read through the node's cache) and this node's copies of its small files,
    each listed in ``copies``."""
    problems, remote, offline = [], is_remote(dataset.prefix), dataset.cache.offline
    folder = cache_root(dataset.cache.folder) / dataset.checksum if remote else None
    for role, entry in (dataset.metadata or {}).get("files", {}).items():
        sources: list[tuple[str, Callable[[str], str]]] = []  # (the name said, its checksum by algorithm)
        if not remote:
            path = fmt.file_path(dataset.prefix, role)
            sources.append((str(path), lambda algorithm, path=path: fmt.hash_file(path, algorithm)))
        elif role in dataset.remote_files and offline:
            file = dataset.remote_files[role]
            sources.append((f"{file.uri} (its blocks in this node's cache)",
                            lambda algorithm, file=file: _hash_read(file, algorithm)))
        else:
            if not offline:
                uri = file_uri(dataset.prefix, role)
                sources.append((uri, lambda algorithm, uri=uri: hash_object(uri, algorithm)))
            if role not in dataset.remote_files and folder is not None:
                copy = small_file_copy(folder, role)
                copies.append(str(copy))
                sources.append((f"{copy} (this node's copy)",
                                lambda algorithm, copy=copy: fmt.hash_file(copy, algorithm)))
        algorithm = fmt.file_hash_algorithm(entry)
        for where, digest in sources:
            try:
                found = digest(algorithm)
            except OSError as error:
                problems.append(f"{where}: cannot be read ({error.strerror})")
                continue
            if found != entry[algorithm]:
                problems.append(f"{where}: {algorithm} checksum differs from the metadata: "
                                "the file was modified or corrupted")
    return problems


def _hash_read(file: RemoteFile, algorithm: str) -> str:
    """The checksum of a remote data file read through the node's cache, by windows."""
    state = fmt.FILE_HASHES[algorithm]()
    for start in range(0, len(file), VERIFY_WINDOW):
        state.update(file[start:min(len(file), start + VERIFY_WINDOW)])
    return state.hexdigest()


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


def counts_by_name(names: tuple[str, ...], counts: np.ndarray) -> dict[str, int]:
    """``counts`` (a bincount of codes) by the name of each code (codes beyond ``names`` by their number),
    without zeros."""
    return {_name(names, code): int(n) for code, n in enumerate(counts.tolist()) if n}


def element_kind_key(elements: np.ndarray) -> np.ndarray:
    """kind·4 + loss + 2·cfg of each plan record, in uint8 (kinds are < 64 in a checked plan): what
    :func:`element_kind_counts` counts, one bincount rather than a copy per kind."""
    flags = elements["flags"]
    loss, cfg = (flags & fmt.FLAG_LOSS) != 0, (flags & fmt.FLAG_ENABLE_CFG) != 0
    return elements["kind"] * np.uint8(4) + loss + cfg * np.uint8(2)


def element_kind_counts(counts: np.ndarray) -> dict[str, dict[str, int]]:
    """Per element kind: how many plan records have it, and how many of those have loss and enable_cfg, from
    the bincount of :func:`element_kind_key` (row k: kind k; its columns: neither flag, loss, cfg, both)."""
    counts = np.pad(counts, (0, -len(counts) % 4)).reshape(-1, 4)
    return {name: {"count": int(counts[code].sum()), "loss": int(counts[code, 1] + counts[code, 3]),
                   "enable_cfg": int(counts[code, 2] + counts[code, 3])} for code, name in enumerate(fmt.KIND_NAMES)}


@dataclass
class PlanTotals:
    """What one streaming pass over every part's plan counts (see :func:`plan_totals`)."""

    views_per_sample: Distribution = field(default_factory=Distribution)
    images_per_sample: Distribution = field(default_factory=Distribution)
    elements_per_view: Distribution = field(default_factory=Distribution)
    image_bytes: Distribution = field(default_factory=Distribution)
    width: Distribution = field(default_factory=Distribution)
    height: Distribution = field(default_factory=Distribution)
    kinds: np.ndarray = field(default_factory=lambda: np.zeros(4 * len(fmt.KIND_NAMES), np.int64))
    formats: np.ndarray = field(default_factory=lambda: np.zeros(len(fmt.IMAGE_FORMATS), np.int64))
    modes: np.ndarray = field(default_factory=lambda: np.zeros(len(fmt.IMAGE_MODES), np.int64))
    views: int = 0
    images: int = 0


def plan_totals(dataset: MMIDXDataset, *, sizes: bool = True) -> PlanTotals | None:
    """The plan's distributions and code counts over every part, a chunk at a time (None without a plan);
    ``sizes=False`` leaves out the distributions of image bytes and elements per view (the viewer shows
    neither)."""
    totals = PlanTotals()
    for part in dataset.parts:
        plan = part.dataset.plan
        if plan is None:
            return None
        info = plan["image_info"]
        totals.views += len(plan["view_element_offsets"]) - 1
        totals.images += len(info)
        for name in ("views_per_sample", "images_per_sample") + (("elements_per_view", "image_bytes") if sizes else ()):
            offsets = plan[{"views_per_sample": "sample_view_offsets", "images_per_sample": "sample_image_offsets",
                            "elements_per_view": "view_element_offsets", "image_bytes": "image_offsets"}[name]]
            for chunk in differences(offsets):
                getattr(totals, name).add(chunk)
        for chunk in chunks(plan["elements"]):
            totals.kinds = add_bincount(totals.kinds, element_kind_key(chunk), 0)
        for chunk in chunks(info):
            totals.width.add(chunk["width"])
            totals.height.add(chunk["height"])
            totals.formats = add_bincount(totals.formats, chunk["format"], 0)
            totals.modes = add_bincount(totals.modes, chunk["mode"], 0)
    return totals


def summary(dataset: MMIDXDataset) -> dict[str, Any]:
    """Counts, size statistics, element kinds, images and file sizes of a dataset, as plain data.

    One streaming pass over each part's index arrays, a chunk at a time (:mod:`mmidx.read.statistics`):
    memory is the distinct values of each distribution, not the samples, and a sharded dataset gives the
    same result as its merge (but its ``files``, those of the top level)."""
    dataset.check_structure()  # the statistics index with the index arrays
    meta = dataset.metadata or {}
    per_sequence, per_sample, sequences = Distribution(), Distribution(), 0
    for part in dataset.parts:
        tokens = part.dataset.tokens
        sequences += tokens.sequence_count
        for chunk in chunks(tokens.sequence_lengths):
            per_sequence.add(chunk)
        for chunk in sample_token_counts(part.dataset):
            per_sample.add(chunk)
    result: dict[str, Any] = {
        "prefix": dataset.prefix,
        "format_version": meta.get("format_version", "megatron"),
        "kind": dataset.kind,
        "token_dtype": dataset.token_dtype.name,
        "tokenizer": (dataset.tokenizer or {}).get("name_or_path"),
        "samples": len(dataset),
        "sequences": sequences,
        "tokens": per_sequence.total,
        "tokens_per_sequence": per_sequence.stats(),
        "tokens_per_sample": per_sample.stats(),
        "files": file_sizes(dataset),
    }
    plan = plan_totals(dataset)
    if plan is not None:
        result.update({
            "views": plan.views,
            "views_per_sample": plan.views_per_sample.stats(),
            "elements_per_view": plan.elements_per_view.stats(),
            "element_kinds": element_kind_counts(plan.kinds),
            "images": {
                "count": plan.images,
                "bytes": plan.image_bytes.stats(),
                "width": plan.width.stats(),
                "height": plan.height.stats(),
                "formats": counts_by_name(fmt.IMAGE_FORMATS, plan.formats),
                "modes": counts_by_name(fmt.IMAGE_MODES, plan.modes),
            },
        })
    names = encoding_names(dataset.prefix)
    if names:
        result["encodings"] = [describe(dataset, name) for name in names]
    return result
