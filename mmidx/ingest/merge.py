"""Merge: shards into the dataset of their build, and ``mmidx merge`` of shard sets or whole datasets.

A build ends in :func:`finish_build`: the shards are merged in unit order into ``OUTPUT`` and the
build report is written last. ``mmidx merge INPUT... --output OUTPUT`` finishes a build that was split over
nodes (``--num-nodes``): its inputs are the shard folders (``OUTPUT.shards``) of the nodes, named in
any order; every unit of the plan must be found in one of them, and the result is byte-identical to
a build on one machine. Its inputs may instead be whole datasets (same kind, tokenizer and format
version, checked), which are concatenated in the order given, with a report (``OUTPUT.report.json``)
naming them. Time and memory are proportional to the index arrays; the output is written crash-safely
(``mmidx.ingest.writer``) under a lock, and a dataset already at ``OUTPUT`` is replaced only as
:mod:`mmidx.ingest.output` allows (a rerun of the same merge reuses it; another dataset needs ``force``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx.fetch.ledger import merge_ledgers
from mmidx.ingest.output import claim_output
from mmidx.ingest.plan import PLAN_NAME, BuildError, finished_shard, meta_sha256, shard_dir, shard_prefix
from mmidx.ingest.report import BuildReport, add_counts, counted, judge, new_counts, report_path
from mmidx.ingest.sharded import choose_layout, write_sharded
from mmidx.ingest.writer import _DatasetWriter
from mmidx.io.files import digest, read_json, write_json
from mmidx.io.lock import output_lock
from mmidx.sources import SKIP_REASONS, WARNING_REASONS, default_max_skip_rate


def _remove_dataset(prefix: str | os.PathLike) -> None:
    """Make the dataset at ``prefix`` stop opening (index first), then delete its other files."""
    for role in ("idx", "meta", "shards", "bin", "images", "plan"):
        fmt.file_path(os.fspath(prefix), role).unlink(missing_ok=True)


def finish_build(output: str, record: dict[str, Any], shards: list[str], reports: list[dict[str, Any]],
                 max_skip_rate: float, reused: int, started: float, layout: str = "auto") -> BuildReport:
    """Make the shard folders ``shards`` (in unit order) the dataset at ``output`` and write its build report: merged
    into one set of files, or kept as the shards of a sharded dataset (:func:`mmidx.ingest.sharded.choose_layout`
    decides for ``layout`` "auto"); the report records which (``layout``).

    A build without a single sample writes no dataset (and removes an old one at ``output``): an
    empty dataset that opens would hide that the inputs were not what the options expected.
    """
    merge_started = time.perf_counter()
    totals = new_counts()
    for report in reports:
        add_counts(totals, report)
    report_path(output).unlink(missing_ok=True)
    chosen = None
    if totals["samples"]:
        chosen = choose_layout(layout, [shard_prefix(folder) for folder in shards])
        if chosen == "sharded":
            shards = _in_place(output, shards)
            write_sharded(output, [int(Path(folder).name) for folder in shards], record["config"])
            _remove_other_shards(output, shards)
        else:
            merge_datasets([shard_prefix(folder) for folder in shards], output, build_config=record["config"])
    else:
        _remove_dataset(output)
    merge_ledgers(shards, output)
    totals["seconds"].update(merge=time.perf_counter() - merge_started, wall=time.perf_counter() - started)
    data = judge({"output": os.fspath(output), "source": record["source"], "key": record["key"],
                  "meta_sha256": meta_sha256(output), "units": len(shards), "reused_units": reused, "layout": chosen,
                  "reasons": {reason: SKIP_REASONS[reason] for reason in totals["skips"]},
                  "warning_reasons": {reason: WARNING_REASONS[reason] for reason in totals["warnings"]}, **totals},
                 max_skip_rate)
    write_json(report_path(output), data, exclusive=True)  # under the output's lock: no other writer is alive
    return BuildReport(data)


def _in_place(output: str, shards: list[str]) -> list[str]:
    """The shard folders ``shards`` moved (renamed) to where a sharded dataset at ``output`` keeps them,
    ``OUTPUT.shards/NNNNN``, when they are elsewhere (the folders of a build split over nodes)."""
    placed = []
    for folder in shards:
        target = Path(f"{output}{fmt.SHARDS_FOLDER_SUFFIX}", Path(folder).name)
        if not target.exists() or not os.path.samefile(folder, target):
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(folder, target)
            except OSError as error:
                raise BuildError(f"cannot move the shard {folder} to {target} ({error.strerror}); merge with "
                                 "--layout single, which copies, or move the shard folders there") from error
        placed.append(os.fspath(target))
    return placed


def _remove_other_shards(output: str, shards: list[str]) -> None:
    """Delete the shard folders in ``OUTPUT.shards`` that the sharded dataset's table does not name (an earlier
    build's, of more units)."""
    kept = {Path(folder).name for folder in shards}
    folder = Path(f"{output}{fmt.SHARDS_FOLDER_SUFFIX}")
    for entry in folder.iterdir():
        if entry.is_dir() and entry.name.isdigit() and entry.name not in kept:
            shutil.rmtree(entry, ignore_errors=True)


def merge_into(output: str | os.PathLike, inputs: list[str | os.PathLike], *,
               max_skip_rate: float | None = None, force: bool = False, layout: str = "auto") -> BuildReport:
    """``mmidx merge``: join shard folders of one build (any order) or whole datasets (in order) into ``output``.

    Shard folders end as their build does (``layout``, :func:`finish_build`); datasets, sharded or not, are
    always written as one set of files (what ``mmidx merge`` of a sharded dataset is for).
    ``max_skip_rate`` None: the default of the build's source (:func:`mmidx.sources.default_max_skip_rate`).
    A dataset already at ``output`` is this merge's result (reused: "already built") or is replaced only with
    ``force`` (:func:`mmidx.ingest.output.claim_output`)."""
    started = time.perf_counter()
    output = fmt.output_prefix(output)
    if not inputs:
        raise BuildError("give at least one input")
    folders = [_shard_folder(os.fspath(item)) for item in inputs]
    plans = [read_json(Path(folder, PLAN_NAME)) if folder else None for folder in folders]
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with output_lock(output, "merge"):
        if all(plan is not None for plan in plans):
            return _merge_shard_sets(output, folders, plans, max_skip_rate, started, force, layout)
        if any(plan is not None for plan in plans):
            raise BuildError("give either the shards of one build (each node's prefix or its PREFIX.shards folder) "
                             "or datasets, not both")
        return _merge_datasets(output, [os.fspath(item) for item in inputs], started, force)


def _shard_folder(item: str) -> str | None:
    """The shard folder an input names: a folder holding a build's plan.json, or the prefix a node of a split
    build wrote to (its shards are in ``PREFIX.shards``, and no dataset is there yet: a sharded dataset keeps its
    shards there too, and is a dataset); None for anything else."""
    for folder in (item, f"{item}.shards"):
        if Path(folder, PLAN_NAME).is_file() and not (folder != item and fmt.holds_dataset(item)):
            return folder
    return None


def _merge_shard_sets(output: str, inputs: list[str], plans: list[dict[str, Any]], max_skip_rate: float | None,
                      started: float, force: bool, layout: str) -> BuildReport:
    first = plans[0]
    if max_skip_rate is None:
        max_skip_rate = default_max_skip_rate(first["source"])
    for folder, plan in zip(inputs[1:], plans[1:], strict=True):
        for what, value in (("kind of source", "source"), ("tokenizer", "tokenizer"), ("mmidx version", "mmidx")):
            mine = plan["config"].get(value) if value != "source" else plan["source"]
            theirs = first["config"].get(value) if value != "source" else first["source"]
            if value == "tokenizer":
                mine, theirs = tokenizer_content(mine), tokenizer_content(theirs)
            if mine != theirs:
                shown = _shown("tokenizer", mine, theirs) if value == "tokenizer" else f"{mine!r} vs {theirs!r}"
                raise BuildError(f"cannot merge {folder} with {inputs[0]}: they were built with a different "
                                 f"{what} ({shown})")
        if plan["key"] != first["key"]:
            raise BuildError(f"cannot merge {folder} with {inputs[0]}: they belong to different builds (other "
                             "inputs or options); every node must run the same mmidx build command")
    folders, reports, missing = [], [], []
    for index, key in enumerate(first["unit_keys"]):
        found = next(((shard_dir(folder, index), report) for folder in inputs
                      if (report := finished_shard(shard_dir(folder, index), key)) is not None), None)
        if found is None:
            missing.append(index)
        else:
            folders.append(os.fspath(found[0]))
            reports.append(found[1])
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise BuildError(f"{len(missing)} of {len(first['unit_keys'])} units have no finished shard in the inputs "
                         f"(units {shown}); run the build of the node(s) that own them again, then merge")
    previous = claim_output(output, first["key"], {"build": first["config"]}, force=force, command="build")
    if previous is not None:
        judged = judge(previous, max_skip_rate)
        return BuildReport({**judged, "already_built": True, "message": "already built: " + judged["message"]})
    return finish_build(output, first, folders, reports, max_skip_rate, len(folders), started, layout)


def _merge_datasets(output: str, inputs: list[str], started: float, force: bool) -> BuildReport:
    """Concatenate whole datasets; the report it writes beside ``output`` names them and their checksums (its key),
    so a rerun of the same merge finds its result."""
    from mmidx.read.dataset import MMIDXDataset

    for number, prefix in enumerate(inputs):
        if _same_dataset(prefix, output):
            raise BuildError(f"{output} is also an input; write the merge to a new prefix")
        for other in inputs[:number]:
            if _same_dataset(prefix, other):
                raise BuildError(f"{prefix} is named twice ({other}); a merge concatenates different datasets, "
                                 "and the same one twice would hold every sample of it twice")
    key = digest({"merge": [[prefix, meta_sha256(prefix)] for prefix in inputs]})
    previous = claim_output(output, key, {"merged_from": inputs}, force=force, command="merge")
    if previous is not None:
        return BuildReport({**previous, "already_built": True, "message": "already merged: " + previous["message"]})
    merge_datasets(inputs, output)
    dataset = MMIDXDataset(output)
    counts = (dataset.metadata or {}).get("counts", {})
    totals = {**new_counts(), "samples": len(dataset), "rows": len(dataset), "tokens": counts.get("tokens", 0),
              "views": counts.get("views", len(dataset)), "images": counts.get("images", 0)}
    totals["seconds"]["wall"] = time.perf_counter() - started
    data = {**totals, "output": output, "key": key, "meta_sha256": meta_sha256(output), "merged_from": inputs,
            "datasets": len(inputs), "ok": True, "message": f"merged {counted(len(inputs), 'dataset')}"}
    write_json(report_path(output), data, exclusive=True)  # under the output's lock: no other writer is alive
    return BuildReport(data)


def _same_dataset(one: str, other: str) -> bool:
    """Whether the prefixes ``one`` and ``other`` name the same dataset (its metadata, or its index, is one file)."""
    for role in ("meta", "idx"):
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(fmt.file_path(one, role), fmt.file_path(other, role)):
                return True
    return False


CHUNK = 1 << 20  # entries of an index array read, shifted and written at a time


def merge_datasets(prefixes: Iterable[str | os.PathLike], output_prefix: str | os.PathLike,
                   *, build_config: dict[str, Any] | None = None) -> Path:
    """Concatenate finished datasets (e.g. the shards of a parallel build) into one at ``output_prefix``.

    It streams: token and image bytes are copied file to file, and every index array is written a chunk of
    ``CHUNK`` entries at a time, shifted by the totals of the datasets before it, so memory stays bounded
    whatever the inputs' sizes, and the files are the same bytes as the concatenated arrays written whole. A
    sharded input is its shards in order. Inputs are mapped (no file descriptor each, at most
    :mod:`mmidx.read.mapped`'s bound at once); beside the output's five files one input file is open at a time.
    Element payloads are local to their sample and so are copied unchanged. With ``build_config`` the inputs
    are the shards of one build and the result records that build; without, it records the inputs
    (``merged_from``) and the first one's build.
    """
    from mmidx.read.dataset import MMIDXDataset

    inputs = [MMIDXDataset(prefix) for prefix in prefixes]
    if not inputs:
        raise ValueError("merge_datasets needs at least one dataset")
    parts = [part.dataset for dataset in inputs for part in dataset.parts]
    first = parts[0]
    for part in parts[1:]:
        for key in ("kind", "token_dtype", "tokenizer", "special_tokens", "format_version"):
            mine, theirs = _merge_key(part, key), _merge_key(first, key)
            if mine != theirs:
                raise ValueError(f"cannot merge {part.prefix} into {first.prefix}: their {_KEY_NAMES[key]} differ "
                                 f"({_shown(key, mine, theirs)})")
    writer = _DatasetWriter(output_prefix, first.kind, first.token_dtype)
    try:
        for part in parts:
            for role, stream in (("bin", writer.tokens), ("images", writer.images)):
                if stream is not None:
                    with open(fmt.file_path(part.prefix, role), "rb") as source:
                        while chunk := source.read(1 << 22):
                            stream.write(chunk)
        counts = _write_token_index(writer.index_file("idx"), first.token_dtype, parts)
        sources, source_shift = [], []
        for part in parts:
            source_shift.append(len(sources))
            sources.extend(part.metadata.get("sources", []) if part.metadata else [])
        if first.kind == "multimodal":
            counts.update(_write_plan(writer.index_file("plan"), parts, source_shift))
        meta = {"tokenizer": first.tokenizer, "special_tokens": first.special_tokens, "sources": sources,
                "counts": counts}
        if build_config is not None:  # the shards of one build: the result is that build's dataset
            meta["build"] = build_config
        else:
            meta.update(build=(inputs[0].metadata or {}).get("build", {}),
                        merged_from=[os.fspath(dataset.prefix) for dataset in inputs])
        return writer.publish(meta)
    except BaseException:
        writer.abort()
        raise


# What merge_datasets compares, in the words of its message.
_KEY_NAMES = {"kind": "kinds", "token_dtype": "token dtypes", "tokenizer": "tokenizers",
              "special_tokens": "special token ids", "format_version": "format versions"}


def tokenizer_content(identity: dict[str, Any] | None) -> dict[str, Any]:
    """What a tokenizer is, from the identity a dataset records: everything but where it was read from
    (``name_or_path``), so the same files named ``./raw/tokenizer/`` or by an absolute path are one tokenizer."""
    return {name: value for name, value in (identity or {}).items() if name != "name_or_path"}


def _merge_key(dataset: Any, key: str) -> Any:
    if key == "format_version":
        return (dataset.metadata or {}).get("format_version", "megatron")
    if key == "tokenizer":
        return tokenizer_content(dataset.tokenizer)
    return getattr(dataset, key)


def _shown(key: str, mine: Any, theirs: Any) -> str:
    """The difference between two values of ``key``, as words (a tokenizer's: the facts that differ)."""
    if key != "tokenizer":
        return f"{mine} vs {theirs}"
    differ = [name for name in sorted(set(mine) | set(theirs)) if mine.get(name) != theirs.get(name)]
    return "; ".join(f"{name.replace('_', ' ')} {mine.get(name, 'none')} vs {theirs.get(name, 'none')}"
                     for name in differ)

def _chunks(array: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, len(array), CHUNK):
        yield array[start:start + CHUNK]


def _write_token_index(out: Any, dtype: np.dtype, parts: list[Any]) -> dict[str, int]:
    """Write the Megatron ``.idx`` of ``parts`` end to end into ``out`` (what :func:`mmidx.format.write_token_index`
    writes for the concatenated lengths and shifted document indices), a chunk at a time; their counts."""
    sequences = sum(part.tokens.sequence_count for part in parts)
    documents = sum(part.tokens.document_count for part in parts)
    out.write(fmt.MEGATRON_MAGIC + struct.pack("<QB", fmt.MEGATRON_VERSION, fmt.CODE_OF_DTYPE[dtype]))
    out.write(struct.pack("<QQ", sequences, documents + 1))
    tokens = 0
    for part in parts:
        for chunk in _chunks(part.tokens.sequence_lengths):
            out.write(np.ascontiguousarray(chunk, dtype="<i4"))
            tokens += int(chunk.sum(dtype=np.int64))
    pointer = 0
    for part in parts:
        for chunk in _chunks(part.tokens.sequence_lengths):
            ends = np.cumsum(chunk, dtype=np.int64) * dtype.itemsize + pointer
            out.write(np.concatenate([[pointer], ends[:-1]]).astype("<i8"))
            pointer = int(ends[-1])
    out.write(np.zeros(1, "<i8"))
    base = 0
    for part in parts:
        _write_shifted(out, part.tokens.document_indices[1:], base)
        base += part.tokens.sequence_count
    return {"samples": documents, "sequences": sequences, "tokens": tokens}


def _write_shifted(out: Any, array: np.ndarray, shift: int) -> None:
    for chunk in _chunks(array):
        out.write(chunk.astype("<i8") + shift)


def _write_plan(out: Any, parts: list[Any], source_shift: list[int]) -> dict[str, int]:
    """Write the ``.plan`` of multimodal ``parts`` end to end into ``out``, a chunk at a time, laid out as
    :func:`mmidx.format.write_plan` lays out the concatenated arrays; their counts."""
    plans = [part.plan for part in parts]
    samples = sum(len(part) for part in parts)
    views = sum(len(plan["view_element_offsets"]) - 1 for plan in plans)
    elements = sum(len(plan["elements"]) for plan in plans)
    images = sum(len(plan["image_info"]) for plan in plans)
    extra = any("sample_extra" in plan for plan in plans)
    shapes = {"sample_view_offsets": (samples + 1,), "sample_image_offsets": (samples + 1,), "sample_origin":
              (samples, 2), "view_element_offsets": (views + 1,), "elements": (elements,), "image_offsets":
              (images + 1,), "image_info": (images,)}
    if extra:
        shapes.update(sample_extra_offsets=(samples + 1,),
                      sample_extra=(sum(len(plan.get("sample_extra", ())) for plan in plans),))
    dtypes = {**fmt.PLAN_ARRAYS, **fmt.PLAN_OPTIONAL_ARRAYS}
    head, entries = fmt.container_layout(fmt.PLAN_MAGIC, {name: (dtypes[name], shape) for name, shape in
                                                         shapes.items()})
    out.write(head)
    written = len(head)
    for entry in entries:
        out.write(b"\x00" * (entry["offset"] - written))
        name = entry["name"]
        if name.endswith("offsets"):  # [0, ..., total] per part: one 0, then each part's rest shifted
            out.write(np.zeros(1, "<i8"))
            shift = 0
            for plan, part in zip(plans, parts, strict=True):
                offsets = plan.get(name, np.zeros(len(part) + 1, np.int64))  # a part without sample_extra
                _write_shifted(out, offsets[1:], shift)
                shift += int(offsets[-1])
        elif name == "sample_origin":
            for plan, shift in zip(plans, source_shift, strict=True):
                for chunk in _chunks(plan["sample_origin"]):
                    chunk = chunk.astype("<i8")
                    chunk[:, 0] = np.where(chunk[:, 0] >= 0, chunk[:, 0] + shift, -1)
                    out.write(chunk)
        else:
            for plan in plans:
                for chunk in _chunks(plan.get(name, np.zeros(0, dtypes[name]))):
                    out.write(np.ascontiguousarray(chunk))
        written = entry["offset"] + entry["nbytes"]
    image_bytes = sum(int(plan["image_offsets"][-1]) for plan in plans)
    return {"views": views, "elements": elements, "images": images, "image_bytes": image_bytes}
