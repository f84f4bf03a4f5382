"""Build a dataset from raw sources: in parallel, resumable after a crash, never losing a row silently.

``build_dataset`` cuts the inputs into work units (``mmidx.sources``), builds each unit into its
own shard — a complete mmidx dataset ``OUTPUT.shards/NNNNN`` plus ``NNNNN.report.json`` written
after it — in ``workers`` processes, then merges the shards in input order into ``OUTPUT`` and
writes ``OUTPUT.report.json``. Every row is either built or skipped with a counted reason.

Crash safety and resumption:

* a shard is reused by a rerun only if its report exists (it is written, atomically, after the
  shard was finalized), names the same unit and build configuration (including the input file's
  size and modification time), and the shard opens with the metadata checksum the report names;
  otherwise the unit is built again (its old report is deleted first);
* shards and the merged output are finalized by ``mmidx.builder``, which renames ``P.idx`` into
  place last: an interrupted build never leaves files that open as a dataset, and an old dataset
  at ``OUTPUT`` stays intact until the new one replaces it whole;
* ``OUTPUT.report.json`` is written last; a rerun whose report and output match the
  configuration does nothing. The shards are deleted once the report is written.

The build fails (``BuildReport.ok`` is False, the CLI exits 1) when nothing was built or more than
``max_skip_rate`` of the rows were skipped; the dataset is still written so it can be inspected.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from queue import Empty
from typing import Any

from mmidx import __version__
from mmidx import format as fmt
from mmidx.builder import DatasetBuilder, merge_datasets
from mmidx.dataset import MMIDXDataset
from mmidx.format import FormatError
from mmidx.sources import SKIP_REASONS, Skip, SourceContext, SourceDocument, SourceOptions, WorkUnit, get_source
from mmidx.tokenizer import Tokenizer

EXAMPLES_PER_REASON = 5
_PROGRESS_INTERVAL = 0.5  # seconds between progress messages of a worker


class BuildError(RuntimeError):
    """A build could not run to its end (not: rows were skipped; those are in the report)."""


@dataclass(frozen=True)
class BuildOptions:
    """One ``mmidx build``: which source reads which inputs, with which tokenizer, into which prefix."""

    source: str
    inputs: tuple[str, ...]
    tokenizer: str
    output: str
    source_options: SourceOptions = field(default_factory=SourceOptions)
    workers: int = 1
    max_skip_rate: float = 0.01
    progress: bool = True

    def __post_init__(self) -> None:
        get_source(self.source)
        if not self.inputs:
            raise ValueError("give at least one input")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        if not 0 <= self.max_skip_rate <= 1:
            raise ValueError(f"max_skip_rate is a fraction in [0, 1], not {self.max_skip_rate}")


# --------------------------------------------------------------------------- counting


def _new_counts() -> dict[str, Any]:
    return {"rows": 0, "samples": 0, "skipped": 0, "views": 0, "images": 0, "tokens": 0, "skips": {},
            "seconds": {}}


def _count_skip(counts: dict[str, Any], skip: Skip, path: str) -> None:
    entry = counts["skips"].setdefault(skip.reason, {"count": 0, "examples": []})
    entry["count"] += 1
    if len(entry["examples"]) < EXAMPLES_PER_REASON:
        entry["examples"].append({"file": path, "row": skip.row, "detail": skip.detail[:500]})
    counts["skipped"] += 1


def _add_counts(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key in ("rows", "samples", "skipped", "views", "images", "tokens"):
        total[key] += part[key]
    for reason, entry in part["skips"].items():
        into = total["skips"].setdefault(reason, {"count": 0, "examples": []})
        into["count"] += entry["count"]
        into["examples"] = (into["examples"] + entry["examples"])[:EXAMPLES_PER_REASON]
    for what, seconds in part["seconds"].items():
        total["seconds"][what] = total["seconds"].get(what, 0.0) + seconds


# --------------------------------------------------------------------------- one unit → one shard


@dataclass(frozen=True)
class _Plan:
    """What every worker needs to build any unit."""

    options: BuildOptions
    config: dict[str, Any]
    shards: str


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write ``obj`` to ``path`` atomically (temporary file, fsync, rename)."""
    temporary = path.with_name(path.name + ".partial")
    with open(temporary, "w") as stream:
        json.dump(obj, stream, indent=1, sort_keys=True)
        stream.write("\n")
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as stream:
            return json.load(stream)
    except (OSError, ValueError):
        return None


def _meta_sha256(prefix: str) -> str | None:
    """The metadata checksum of the dataset at ``prefix`` if it opens, else None."""
    try:
        return (MMIDXDataset(prefix).metadata or {}).get("meta_sha256")
    except FormatError:
        return None


def _digest(obj: Any) -> str:
    return hashlib.sha256(fmt.canonical_json(obj)).hexdigest()


def _unit_key(unit: WorkUnit, config: dict[str, Any]) -> str:
    return _digest({"unit": asdict(unit), "config": config})


def _shard_paths(plan: _Plan, index: int) -> tuple[str, Path]:
    prefix = os.path.join(plan.shards, f"{index:05d}")
    return prefix, Path(prefix + ".report.json")


def _finished_shard(plan: _Plan, index: int, unit: WorkUnit) -> dict[str, Any] | None:
    """The report of a shard a previous run finished for this very unit and configuration, if any."""
    prefix, report_path = _shard_paths(plan, index)
    report = _read_json(report_path)
    if report is None or report.get("key") != _unit_key(unit, plan.config):
        return None
    return report if _meta_sha256(prefix) == report.get("meta_sha256") else None


def _build_unit(plan: _Plan, index: int, unit: WorkUnit, tokenizer: Tokenizer,
                progress: Callable[[int, int, int], None]) -> dict[str, Any]:
    """Build ``unit`` into shard ``index`` and write its report; returns the report."""
    prefix, report_path = _shard_paths(plan, index)
    report_path.unlink(missing_ok=True)
    source = get_source(plan.options.source)
    context = SourceContext(tokenizer, plan.options.source_options)
    counts = _new_counts()
    started = last = time.perf_counter()
    pending = [0, 0, 0]  # rows, images, tokens not yet reported
    with DatasetBuilder(prefix, kind=source.KIND, vocab_size=tokenizer.vocab_size, tokenizer=tokenizer.identity,
                        special_tokens=tokenizer.special_tokens, build_config=plan.config) as builder:
        origin = builder.source_id(unit.path)
        for item in source.read(unit, context):
            counts["rows"] += 1
            pending[0] += 1
            if isinstance(item, Skip):
                _count_skip(counts, item, unit.path)
            else:
                with context.timed("write"):
                    if isinstance(item, SourceDocument):
                        builder.add_document([item.tokens])
                        tokens, images, views = len(item.tokens), 0, 1
                    else:
                        builder.add_sample(item.texts, item.images, item.views, (origin, item.row), item.extra)
                        tokens, images, views = sum(map(len, item.texts)), len(item.images), len(item.views)
                counts["samples"] += 1
                counts["views"] += views
                counts["images"] += images
                counts["tokens"] += tokens
                pending[1] += images
                pending[2] += tokens
            now = time.perf_counter()
            if now - last > _PROGRESS_INTERVAL:
                progress(*pending)
                pending, last = [0, 0, 0], now
        with context.timed("write"):
            builder.finalize()
    progress(*pending)
    counts["seconds"] = {**context.seconds, "total": time.perf_counter() - started}
    report = {"key": _unit_key(unit, plan.config), "unit": asdict(unit), "meta_sha256": _meta_sha256(prefix),
              **counts}
    _write_json(report_path, report)
    return report


# Worker processes keep the tokenizer and the progress queue they were started with.
_worker: dict[str, Any] = {}


def _start_worker(tokenizer: Tokenizer, queue: Any) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _worker.update(tokenizer=tokenizer, queue=queue)


def _worker_build_unit(plan: _Plan, index: int, unit: WorkUnit) -> dict[str, Any]:
    queue = _worker["queue"]
    return _build_unit(plan, index, unit, _worker["tokenizer"], lambda *delta: queue.put(delta))


# --------------------------------------------------------------------------- the whole build


class _Progress:
    """A tqdm bar over rows with images/s and tokens/s beside it."""

    def __init__(self, total: int | None, done: int, enabled: bool, label: str):
        from tqdm import tqdm

        # rows of reused shards count as done from the start, not in the rates
        self.bar = tqdm(total=total, initial=done, unit="rows", disable=not enabled, desc=label,
                        dynamic_ncols=True, file=sys.stderr)
        self.images = self.tokens = 0
        self.started = time.perf_counter()

    def update(self, rows: int, images: int, tokens: int) -> None:
        self.images += images
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.images / elapsed:,.0f} images/s, {self.tokens / elapsed:,.0f} tokens/s",
                                 refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()


@contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """Keep the tokenizers library on one thread, so ``workers`` says how many cores a build uses."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


@contextmanager
def _failure_names(index: int, unit: WorkUnit) -> Iterator[None]:
    """Turn a failure while building ``unit`` into a BuildError that names it."""
    try:
        yield
    except Exception as error:
        raise BuildError(f"building {unit.label} (unit {index}) failed: {error}") from error


def _run_units(plan: _Plan, todo: list[tuple[int, WorkUnit]], tokenizer: Tokenizer,
               progress: _Progress) -> dict[int, dict[str, Any]]:
    """Build the units of ``todo``, in this process or in a pool of workers; returns their reports."""
    workers = min(plan.options.workers, len(todo))
    if workers <= 1:
        reports = {}
        for index, unit in todo:
            with _failure_names(index, unit):
                reports[index] = _build_unit(plan, index, unit, tokenizer, progress.update)
        return reports
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    queue = context.Queue()
    reports = {}
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                             initargs=(tokenizer, queue)) as pool:
        futures: dict[Future, tuple[int, WorkUnit]] = {
            pool.submit(_worker_build_unit, plan, index, unit): (index, unit) for index, unit in todo}
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(queue, progress)
                for future in done:
                    index, unit = futures[future]
                    with _failure_names(index, unit):
                        reports[index] = future.result()
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    _drain(queue, progress)
    return reports


def _drain(queue: Any, progress: _Progress) -> None:
    while True:
        try:
            progress.update(*queue.get_nowait())
        except Empty:
            return


@dataclass
class BuildReport:
    """What a build did: counts, skips by reason with examples, timings, and whether it passed."""

    data: dict[str, Any]

    @property
    def ok(self) -> bool:
        return bool(self.data["ok"])

    @property
    def message(self) -> str:
        return self.data["message"]

    def summary(self) -> str:
        """A few human-readable lines: what was built, what was skipped and why."""
        d = self.data
        lines = [f"{d['output']}: {d['samples']:,} samples ({d['views']:,} views, {d['images']:,} images, "
                 f"{d['tokens']:,} tokens) from {d['rows']:,} rows in {d['seconds'].get('wall', 0):.1f} s; "
                 f"{d['units']} units, {d['reused_units']} reused"]
        for reason, entry in sorted(d["skips"].items(), key=lambda item: -item[1]["count"]):
            example = entry["examples"][0] if entry["examples"] else {}
            lines.append(f"  skipped {entry['count']:,} × {reason}: {SKIP_REASONS.get(reason, '')}"
                         f" (e.g. {example.get('file')} row {example.get('row')}: {example.get('detail')})")
        lines.append(("OK: " if self.ok else "FAILED: ") + self.message)
        return "\n".join(lines)


def report_path(output: str | os.PathLike) -> Path:
    """Where the build report of dataset ``output`` lives."""
    return Path(os.fspath(output) + ".report.json")


def build_dataset(options: BuildOptions) -> BuildReport:
    """Build ``options.output`` from ``options.inputs``; see the module docstring for the guarantees."""
    started = time.perf_counter()
    source = get_source(options.source)
    with _single_threaded_tokenizers():
        tokenizer = Tokenizer(options.tokenizer)
        if source.KIND == "text" and tokenizer.eod is None:
            raise BuildError(f"the tokenizer {options.tokenizer!r} has no eos token to end documents with; "
                             "text datasets need one (set eos_token in its tokenizer_config.json)")
        units = source.work_units(list(options.inputs), options.source_options)
        config = {"mmidx": __version__, "source": options.source, "inputs": list(options.inputs),
                  "options": asdict(options.source_options), "tokenizer": tokenizer.identity}
        key = _digest({"config": config, "units": [asdict(u) for u in units]})
        final_report = report_path(options.output)
        previous = _read_json(final_report)
        if previous and previous.get("key") == key and _meta_sha256(options.output) == previous.get("meta_sha256"):
            return BuildReport({**previous, "message": "already built: " + previous["message"]})
        final_report.unlink(missing_ok=True)
        plan = _Plan(options, config, os.fspath(options.output) + ".shards")
        os.makedirs(plan.shards, exist_ok=True)
        reports = {index: report for index, unit in enumerate(units)
                   if (report := _finished_shard(plan, index, unit)) is not None}
        todo = [(index, unit) for index, unit in enumerate(units) if index not in reports]
        known_rows = [unit.rows for unit in units]
        progress = _Progress(sum(known_rows) if None not in known_rows else None,
                             sum(report["rows"] for report in reports.values()), options.progress,
                             f"{options.source} → {os.path.basename(options.output)}")
        reused = len(reports)
        try:
            reports.update(_run_units(plan, todo, tokenizer, progress))
        finally:
            progress.close()
    merge_started = time.perf_counter()
    merge_datasets([_shard_paths(plan, index)[0] for index in range(len(units))], options.output,
                   build_config=config)
    totals = _new_counts()
    for index in range(len(units)):
        _add_counts(totals, reports[index])
    totals["seconds"].update(merge=time.perf_counter() - merge_started, wall=time.perf_counter() - started)
    skip_rate = totals["skipped"] / totals["rows"] if totals["rows"] else 0.0
    if totals["samples"] == 0:
        ok, message = False, (f"nothing was built from {totals['rows']} rows; see the skip reasons above"
                              if totals["rows"] else "the inputs hold no rows")
    elif skip_rate > options.max_skip_rate:
        ok, message = False, (f"{skip_rate:.2%} of the rows were skipped, more than --max-skip-rate "
                              f"{options.max_skip_rate:.2%}; the dataset was written, but check the inputs")
    else:
        ok, message = True, f"skipped {skip_rate:.2%} of the rows (limit {options.max_skip_rate:.2%})"
    data = {"output": os.fspath(options.output), "source": options.source, "key": key,
            "meta_sha256": _meta_sha256(options.output), "units": len(units), "reused_units": reused,
            "skip_rate": skip_rate, "max_skip_rate": options.max_skip_rate, "ok": ok, "message": message,
            "reasons": {reason: SKIP_REASONS[reason] for reason in totals["skips"]}, **totals}
    _write_json(final_report, data)
    shutil.rmtree(plan.shards, ignore_errors=True)
    return BuildReport(data)


# --------------------------------------------------------------------------- BAGEL data configs

GROUP_SOURCES = {"t2i_pretrain": "t2i", "unified_edit": "edit", "vlm_sft": "vlm"}
DATA_CONFIG_NAME = "data.yaml"


def _load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as stream:
            loaded = yaml.safe_load(stream)
    except (OSError, yaml.YAMLError) as error:
        raise BuildError(f"cannot read {path}: {error}") from error
    if not isinstance(loaded, dict):
        raise BuildError(f"{path}: expected a mapping at the top level")
    return loaded


def _group_builds(group: str, spec: dict[str, Any], info: dict[str, Any], info_folder: str, output_dir: str,
                  settings: dict[str, Any]) -> list[BuildOptions]:
    """The builds of one group of a BAGEL data config: one per dataset name, inputs from the dataset info."""
    if group not in GROUP_SOURCES:
        raise BuildError(f"group {group!r}: mmidx builds the BAGEL groups {', '.join(GROUP_SOURCES)}")
    source = GROUP_SOURCES[group]
    builds = []
    for name in spec.get("dataset_names", []):
        entry = info.get(group, {}).get(name)
        if not isinstance(entry, dict) or "data_dir" not in entry:
            raise BuildError(f"the dataset info has no data_dir for {group}/{name}")
        where = {key: os.path.join(info_folder, entry[key]) for key in ("data_dir", "jsonl_path") if key in entry}
        options = settings["source_options"]
        if source == "vlm":
            if "jsonl_path" not in where:
                raise BuildError(f"the dataset info has no jsonl_path for {group}/{name}")
            frames = spec.get("frame_sampler_args", {})
            options = replace(options, image_root=where["data_dir"],
                              min_frames=frames.get("min_num_frames", options.min_frames),
                              max_frames=frames.get("max_num_frames", options.max_frames))
        inputs = (where["jsonl_path"],) if source == "vlm" else (where["data_dir"],)
        builds.append(BuildOptions(source, inputs, output=os.path.join(output_dir, group, name),
                                   **{**settings, "source_options": options}))
    return builds


def build_from_config(config: str | os.PathLike, dataset_info: str | os.PathLike, output_dir: str | os.PathLike,
                      *, tokenizer: str, source_options: SourceOptions | None = None, workers: int = 1,
                      max_skip_rate: float = 0.01, progress: bool = True) -> list[BuildReport]:
    """Build every (group, dataset name) of a BAGEL data YAML and write ``output_dir/data.yaml``.

    ``config`` has BAGEL's ``data/configs/*.yaml`` shape; ``dataset_info`` maps group → dataset name →
    ``data_dir`` (parquet folder, or image folder for ``vlm_sft``) and ``jsonl_path``, as BAGEL's
    ``DATASET_INFO`` (relative paths are relative to the info file). The other arguments apply to
    every build; a group's ``frame_sampler_args`` set its frame counts. ``num_used_data`` is not
    applied: every file is built once, and how often a group is drawn is its ``weight``. The data
    config is written only when every build passed.
    """
    import yaml

    groups, info = _load_yaml(config), _load_yaml(dataset_info)
    output_dir = os.fspath(output_dir)
    info_folder = os.path.dirname(os.path.abspath(dataset_info))
    settings = {"tokenizer": tokenizer, "source_options": source_options or SourceOptions(), "workers": workers,
                "max_skip_rate": max_skip_rate, "progress": progress}
    plans = {group: _group_builds(group, spec or {}, info, info_folder, output_dir, settings)
             for group, spec in groups.items()}
    reports = [build_dataset(options) for builds in plans.values() for options in builds]
    if all(report.ok for report in reports):
        data_config: dict[str, Any] = {"groups": {}}
        for group, builds in plans.items():
            spec = groups[group] or {}
            entry = {"datasets": [os.path.relpath(options.output, output_dir) for options in builds],
                     "weight": float(spec.get("weight", 1.0)), "is_mandatory": bool(spec.get("is_mandatory", False)),
                     "image_transform_args": dict(spec.get("image_transform_args", {}))}
            if "vit_image_transform_args" in spec:
                entry["vit_image_transform_args"] = dict(spec["vit_image_transform_args"])
            data_config["groups"][group] = entry
        temporary = Path(output_dir, DATA_CONFIG_NAME + ".partial")
        temporary.write_text(yaml.safe_dump(data_config, sort_keys=False))
        os.replace(temporary, Path(output_dir, DATA_CONFIG_NAME))
    return reports


# --------------------------------------------------------------------------- command line


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part for part in value.split(",") if part)


def _source_options(args: argparse.Namespace) -> SourceOptions:
    return SourceOptions(
        views=args.views, seed=args.seed, image_root=args.image_root, max_image_size=args.max_image_size,
        max_image_pixels=args.max_image_pixels, min_frames=args.min_frames, max_frames=args.max_frames,
        text_key=args.text_key, extra_keys=args.extra_keys, prompt_key=args.prompt_key,
        caption_key=args.caption_key, rows_per_shard=args.rows_per_shard, bytes_per_shard=args.bytes_per_shard)


def cmd_build(args: argparse.Namespace) -> int:
    """``mmidx build``: one source into one dataset, or every group of a BAGEL data config."""
    from mmidx.sources import SourceError
    from mmidx.tokenizer import TokenizerError

    single = (args.source, args.input, args.output)
    multi = (args.config, args.dataset_info, args.output_dir)
    if not (all(single) and not any(multi)) and not (all(multi) and not any(single)):
        print("mmidx build: give either --source, --input and --output, or --config, --dataset-info and "
              "--output-dir", file=sys.stderr)
        return 2
    settings = {"tokenizer": args.tokenizer, "workers": args.workers, "max_skip_rate": args.max_skip_rate,
                "progress": not args.quiet}
    try:
        if all(single):
            reports = [build_dataset(BuildOptions(args.source, tuple(args.input), output=args.output,
                                                  source_options=_source_options(args), **settings))]
        else:
            reports = build_from_config(args.config, args.dataset_info, args.output_dir,
                                        source_options=_source_options(args), **settings)
    except (BuildError, SourceError, TokenizerError, ValueError) as error:
        print(f"mmidx build: {error}", file=sys.stderr)
        return 1
    for report in reports:
        print(report.summary())
    return 0 if all(report.ok for report in reports) else 1


def register(commands: Any) -> None:
    """Add ``mmidx build`` to the command line."""
    from mmidx.cli import add_command
    from mmidx.sources import SOURCE_NAMES

    defaults = SourceOptions()
    sub = add_command(commands, "build", cmd_build,
                      "Build an mmidx dataset from raw sources (t2i/edit parquet, VLM/chat/text JSONL, RL prompt "
                      "files, WebDataset tars), or every group of a BAGEL data config.")
    sub.add_argument("--source", choices=SOURCE_NAMES, help="the kind of input")
    sub.add_argument("--input", nargs="+", action="extend", help="input files or folders (local or pyarrow URIs)")
    sub.add_argument("--output", help="output dataset prefix (a report goes to PREFIX.report.json)")
    sub.add_argument("--config", help="BAGEL data config (data/configs/*.yaml shape)")
    sub.add_argument("--dataset-info", help="YAML mapping group → dataset name → data_dir / jsonl_path")
    sub.add_argument("--output-dir", help="folder for the datasets of --config and their data.yaml")
    sub.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory or cached name")
    sub.add_argument("--views", type=int, default=defaults.views, help="views (augmentations) per sample")
    sub.add_argument("--workers", type=int, default=1, help="worker processes")
    sub.add_argument("--seed", type=int, default=defaults.seed, help="seed of every random draw")
    sub.add_argument("--image-root", help="folder that image and video names in JSONL rows are relative to")
    sub.add_argument("--max-image-size", type=int, help="downsize and re-encode images whose long edge is larger")
    sub.add_argument("--max-image-pixels", type=int,
                     help="refuse images with more pixels (decompression bombs; default 2^27)")
    sub.add_argument("--max-skip-rate", type=float, default=0.01,
                     help="fail when a larger fraction of the rows is skipped (default 0.01)")
    sub.add_argument("--min-frames", type=int, default=defaults.min_frames, help="fewest frames drawn per video")
    sub.add_argument("--max-frames", type=int, default=defaults.max_frames, help="most frames drawn per video")
    sub.add_argument("--text-key", default=defaults.text_key, help="JSON field of a text document")
    sub.add_argument("--extra-keys", type=_csv, default=(),
                     help="chat: comma-separated fields placed before the conversation, without loss")
    sub.add_argument("--prompt-key", default=defaults.prompt_key, help="prompts: JSON field of the prompt")
    sub.add_argument("--caption-key", default=defaults.caption_key, help="wds: caption field of .json members")
    sub.add_argument("--rows-per-shard", type=int, default=defaults.rows_per_shard,
                     help="parquet rows per work unit (row groups are never split)")
    sub.add_argument("--bytes-per-shard", type=int, default=defaults.bytes_per_shard,
                     help="JSONL bytes per work unit (cut at line starts)")
    sub.add_argument("--quiet", action="store_true", help="no progress bar")
