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
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx.fetch.ledger import merge_ledgers
from mmidx.ingest.output import claim_output
from mmidx.ingest.plan import PLAN_NAME, BuildError, finished_shard, meta_sha256, shard_dir, shard_prefix
from mmidx.ingest.report import BuildReport, add_counts, counted, judge, new_counts, report_path
from mmidx.ingest.writer import _DatasetWriter
from mmidx.io.files import digest, read_json, write_json
from mmidx.io.lock import output_lock
from mmidx.sources import SKIP_REASONS, WARNING_REASONS, default_max_skip_rate


def _remove_dataset(prefix: str | os.PathLike) -> None:
    """Make the dataset at ``prefix`` stop opening (index first), then delete its other files."""
    for role in ("idx", "meta", "bin", "images", "plan"):
        fmt.file_path(os.fspath(prefix), role).unlink(missing_ok=True)


def finish_build(output: str, record: dict[str, Any], shards: list[str], reports: list[dict[str, Any]],
                 max_skip_rate: float, reused: int, started: float) -> BuildReport:
    """Merge the shard folders ``shards`` (in unit order) into ``output`` and write its build report.

    A build without a single sample writes no dataset (and removes an old one at ``output``): an
    empty dataset that opens would hide that the inputs were not what the options expected.
    """
    merge_started = time.perf_counter()
    totals = new_counts()
    for report in reports:
        add_counts(totals, report)
    report_path(output).unlink(missing_ok=True)
    if totals["samples"]:
        merge_datasets([shard_prefix(folder) for folder in shards], output, build_config=record["config"])
    else:
        _remove_dataset(output)
    merge_ledgers(shards, output)
    totals["seconds"].update(merge=time.perf_counter() - merge_started, wall=time.perf_counter() - started)
    data = judge({"output": os.fspath(output), "source": record["source"], "key": record["key"],
                  "meta_sha256": meta_sha256(output), "units": len(shards), "reused_units": reused,
                  "reasons": {reason: SKIP_REASONS[reason] for reason in totals["skips"]},
                  "warning_reasons": {reason: WARNING_REASONS[reason] for reason in totals["warnings"]}, **totals},
                 max_skip_rate)
    write_json(report_path(output), data, exclusive=True)  # under the output's lock: no other writer is alive
    return BuildReport(data)


def merge_into(output: str | os.PathLike, inputs: list[str | os.PathLike], *,
               max_skip_rate: float | None = None, force: bool = False) -> BuildReport:
    """``mmidx merge``: join shard folders of one build (any order) or whole datasets (in order) into ``output``.

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
            return _merge_shard_sets(output, folders, plans, max_skip_rate, started, force)
        if any(plan is not None for plan in plans):
            raise BuildError("give either the shards of one build (each node's prefix or its PREFIX.shards folder) "
                             "or datasets, not both")
        return _merge_datasets(output, [os.fspath(item) for item in inputs], started, force)


def _shard_folder(item: str) -> str | None:
    """The shard folder an input names: a folder holding a build's plan.json, or the prefix a node of a split
    build wrote to (its shards are in ``PREFIX.shards``, and no dataset is there yet); None for anything else."""
    for folder in (item, f"{item}.shards"):
        if Path(folder, PLAN_NAME).is_file() and not (folder != item and Path(f"{item}.idx").exists()):
            return folder
    return None


def _merge_shard_sets(output: str, inputs: list[str], plans: list[dict[str, Any]], max_skip_rate: float | None,
                      started: float, force: bool) -> BuildReport:
    first = plans[0]
    if max_skip_rate is None:
        max_skip_rate = default_max_skip_rate(first["source"])
    for folder, plan in zip(inputs[1:], plans[1:], strict=True):
        for what, value in (("kind of source", "source"), ("tokenizer", "tokenizer"), ("mmidx version", "mmidx")):
            mine = plan["config"].get(value) if value != "source" else plan["source"]
            theirs = first["config"].get(value) if value != "source" else first["source"]
            if mine != theirs:
                raise BuildError(f"cannot merge {folder} with {inputs[0]}: they were built with a different "
                                 f"{what} ({mine!r} vs {theirs!r})")
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
    return finish_build(output, first, folders, reports, max_skip_rate, len(folders), started)


def _merge_datasets(output: str, inputs: list[str], started: float, force: bool) -> BuildReport:
    """Concatenate whole datasets; the report it writes beside ``output`` names them and their checksums (its key),
    so a rerun of the same merge finds its result."""
    from mmidx.read.dataset import MMIDXDataset

    for prefix in inputs:
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(prefix + ".idx", output + ".idx"):
                raise BuildError(f"{output} is also an input; write the merge to a new prefix")
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


def merge_datasets(prefixes: Iterable[str | os.PathLike], output_prefix: str | os.PathLike,
                   *, build_config: dict[str, Any] | None = None) -> Path:
    """Concatenate finished datasets (e.g. the shards of a parallel build) into one at ``output_prefix``.

    Time and memory are proportional to the index arrays: token and image bytes are streamed file
    to file, and every offset array is shifted with one vectorised operation per input. Element
    payloads are local to their sample and so are copied unchanged. With ``build_config`` the inputs
    are the shards of one build and the result records that build; without, it records the inputs
    (``merged_from``) and the first one's build.
    """
    from mmidx.read.dataset import MMIDXDataset

    parts = [MMIDXDataset(prefix) for prefix in prefixes]
    if not parts:
        raise ValueError("merge_datasets needs at least one dataset")
    first = parts[0]
    for part in parts[1:]:
        for key in ("kind", "token_dtype", "tokenizer", "special_tokens", "format_version"):
            mine, theirs = _merge_key(part, key), _merge_key(first, key)
            if mine != theirs:
                raise ValueError(f"cannot merge {part.prefix} into {first.prefix}: their {key} differ "
                                 f"({mine!r} vs {theirs!r})")
    writer = _DatasetWriter(output_prefix, first.kind, first.token_dtype)
    try:
        for part in parts:
            for role, stream in (("bin", writer.tokens), ("images", writer.images)):
                if stream is not None:
                    with open(fmt.file_path(part.prefix, role), "rb") as source:
                        while chunk := source.read(1 << 22):
                            stream.write(chunk)
        lengths = np.concatenate([part.tokens.sequence_lengths for part in parts])
        documents = _concatenate_offsets([part.tokens.document_indices for part in parts])
        sources, source_shift = [], []
        for part in parts:
            source_shift.append(len(sources))
            sources.extend(part.metadata.get("sources", []) if part.metadata else [])
        plan = None
        counts = {"samples": len(documents) - 1, "sequences": len(lengths), "tokens": int(lengths.sum(dtype=np.int64))}
        if first.kind == "multimodal":
            plans = [part.plan for part in parts]
            origins = []
            for part_plan, shift in zip(plans, source_shift, strict=True):
                origin = part_plan["sample_origin"].copy()
                origin[:, 0] = np.where(origin[:, 0] >= 0, origin[:, 0] + shift, -1)
                origins.append(origin)
            plan = {
                "sample_view_offsets": _concatenate_offsets([p["sample_view_offsets"] for p in plans]),
                "sample_image_offsets": _concatenate_offsets([p["sample_image_offsets"] for p in plans]),
                "sample_origin": np.concatenate(origins).reshape(-1, 2),
                "view_element_offsets": _concatenate_offsets([p["view_element_offsets"] for p in plans]),
                "elements": np.concatenate([p["elements"] for p in plans]),
                "image_offsets": _concatenate_offsets([p["image_offsets"] for p in plans]),
                "image_info": np.concatenate([p["image_info"] for p in plans]),
            }
            if any("sample_extra" in p for p in plans):
                plan["sample_extra_offsets"] = _concatenate_offsets(
                    [p.get("sample_extra_offsets", np.zeros(len(part) + 1, np.int64)) for p, part in zip(plans, parts,
                                                                                                         strict=True)])
                plan["sample_extra"] = np.concatenate([p.get("sample_extra", np.zeros(0, np.uint8)) for p in plans])
            counts.update(views=len(plan["view_element_offsets"]) - 1, elements=len(plan["elements"]),
                          images=len(plan["image_info"]), image_bytes=int(plan["image_offsets"][-1]))
        meta = {"tokenizer": first.tokenizer, "special_tokens": first.special_tokens, "sources": sources,
                "counts": counts}
        if build_config is not None:  # the shards of one build: the result is that build's dataset
            meta["build"] = build_config
        else:
            meta.update(build=(first.metadata or {}).get("build", {}),
                        merged_from=[os.fspath(part.prefix) for part in parts])
        return writer.commit(lengths, documents, plan, meta)
    except BaseException:
        writer.abort()
        raise


def _merge_key(dataset: Any, key: str) -> Any:
    if key == "format_version":
        return (dataset.metadata or {}).get("format_version", "megatron")
    return getattr(dataset, key)


def _concatenate_offsets(offset_arrays: list[np.ndarray]) -> np.ndarray:
    """Join arrays of the form [0, ..., total] into one, shifting each by the totals before it."""
    shifts = np.cumsum([0] + [int(a[-1]) for a in offset_arrays[:-1]], dtype=np.int64)
    pieces = [offset_arrays[0][:1].astype(np.int64)]
    pieces += [a[1:].astype(np.int64) + shift for a, shift in zip(offset_arrays, shifts, strict=True)]
    return np.concatenate(pieces)
