"""``mmidx demo``: the whole path on generated data — build → index → packed batches — with a summary.

Generates a small BAGEL-format corpus (:mod:`mmidx.toolkit.synthetic`), builds one mmidx dataset per
group of a BAGEL-style data YAML (t2i, edit, vlm with a few videos), builds the pack index,
iterates every pack through the torch loader, builds the attention masks of one pack both ways,
verifies every dataset, and prints what happened and how fast.

The demo runs again in its own folder: it keeps a record, ``demo.json``, of the corpus it generated (its
:class:`~mmidx.toolkit.synthetic.CorpusSpec` and each file's sha256). A rerun whose corpus is unchanged on disk
reuses it untouched, so every build finds its dataset already built from the same inputs; a corpus of another spec,
or one edited, is generated again, the files of the last corpus it no longer holds are removed, and the demo's
datasets are rebuilt. The demo never writes into a folder that holds files and no such record (a folder of the
user's), and never deletes a file it did not generate.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml

from mmidx.errors import MMIDXError
from mmidx.io.files import read_json, write_json
from mmidx.toolkit.synthetic import CorpusSpec, write_corpus

BAGEL_GROUPS = {
    "t2i_pretrain": {"dataset_names": ["t2i"], "is_mandatory": True, "weight": 1,
                     "image_transform_args": {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512}},
    "unified_edit": {"dataset_names": ["seedxedit_multi"], "is_mandatory": False, "weight": 1,
                     "image_transform_args": {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512},
                     "vit_image_transform_args": {"image_stride": 14, "max_image_size": 518, "min_image_size": 224}},
    "vlm_sft": {"dataset_names": ["llava_ov"], "is_mandatory": True, "weight": 1,
                "image_transform_args": {"image_stride": 14, "max_image_size": 980, "min_image_size": 378,
                                         "max_pixels": 2_007_040},
                "frame_sampler_args": {"max_num_frames": 12, "min_num_frames": 8}},
}


RECORD = "demo.json"  # in the demo's folder: the corpus it generated there (spec, each file's sha256)
_RECORD_FORMAT = 1
QUICK = CorpusSpec(t2i_rows=8, edit_rows=4, vlm_lines=16, vlm_images=8, vlm_videos=1)
FULL = CorpusSpec(vlm_videos=2)


class DemoError(MMIDXError):
    """The demo's folder holds files the demo did not make."""


STEPS = {"generate": "generating a BAGEL-format corpus", "build": "building one dataset per group",
         "index": "building the pack index", "batches": "iterating every pack through the torch loader",
         "block_mask": "building pack 0's BlockMask", "dense_masks": "building pack 0's dense masks",
         "verify": "verifying every dataset"}


def run(workdir: str | Path, *, quick: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the demo in ``workdir`` and return its summary; ``progress`` is told of each step as it starts.

    ``workdir`` is created, or is empty, or is an earlier demo's folder (see the module's docstring); a folder
    holding anything else is refused with a :class:`DemoError` before anything is written."""
    from mmidx.config import DataConfig
    from mmidx.index.pack_index import build_pack_index
    from mmidx.ingest import build_from_config
    from mmidx.pack.builder import PackBuilder
    from mmidx.read.checks import verify
    from mmidx.train.loader import PackDataset, PackLoader

    workdir = Path(workdir).resolve()  # the dataset info below names absolute paths
    timings: dict[str, float] = {}
    last = claim_folder(workdir)

    def step(label: str, what: str | None = None) -> None:
        if progress is not None:
            progress(f"[{list(STEPS).index(label) + 1}/{len(STEPS)}] {what or STEPS[label]}...")

    def timed(label: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        step(label)
        start = time.perf_counter()
        result = function(*args, **kwargs)
        timings[label] = time.perf_counter() - start
        return result

    spec, raw = QUICK if quick else FULL, workdir / "raw"
    unchanged = corpus_unchanged(workdir, spec, last)
    step("generate", "reusing the BAGEL-format corpus of the last run (unchanged)" if unchanged else None)
    start = time.perf_counter()
    if not unchanged:
        generate_corpus(workdir, spec, last)
    timings["generate"] = time.perf_counter() - start
    (workdir / "bagel.yaml").write_text(yaml.safe_dump(BAGEL_GROUPS, sort_keys=False))
    (workdir / "dataset_info.yaml").write_text(yaml.safe_dump({
        "t2i_pretrain": {"t2i": {"data_dir": str(raw / "t2i")}},
        "unified_edit": {"seedxedit_multi": {"data_dir": str(raw / "editing" / "seedxedit_multi")}},
        "vlm_sft": {"llava_ov": {"data_dir": str(raw / "vlm" / "images"),
                                 "jsonl_path": str(raw / "vlm" / "sft.jsonl")}},
    }))
    # force: the datasets under the demo's own folder are the demo's to replace when its corpus was generated again
    reports = timed("build", build_from_config, workdir / "bagel.yaml", workdir / "dataset_info.yaml",
                     workdir / "datasets", tokenizer=str(raw / "tokenizer"), workers=2, progress=False, force=True)
    config = DataConfig.from_yaml(workdir / "datasets" / "data.yaml")
    index = timed("index", build_pack_index, config, cache_dir=workdir / "index")
    torch.set_num_threads(1)
    loader = PackLoader(PackDataset(index, PackBuilder(config)), global_batch_size=1)
    step("batches")
    start, packs, tokens, nbytes, first = time.perf_counter(), 0, 0, 0, None
    for batch in loader:
        first = first or batch
        packs += 1
        tokens += batch.sequence_length
        nbytes += sum(t.numel() * t.element_size() for t in batch.tensors.values() if isinstance(t, torch.Tensor))
    timings["batches"] = time.perf_counter() - start
    flex = timed("block_mask", first.attention_masks)
    dense_batch = PackBuilder(config, use_flex=False).build(0, index.items(0))
    dense = timed("dense_masks", dense_batch.attention_masks)
    problems = timed("verify", lambda: [p for group in config.groups for prefix in group.datasets
                                         for p in verify(prefix)])
    return {"workdir": str(workdir), "reports": reports, "index": index, "timings": timings, "packs": packs,
            "tokens": tokens, "bytes": nbytes, "block_mask": flex, "dense_masks": dense, "problems": problems,
            "config": config}


def claim_folder(workdir: Path) -> dict[str, Any] | None:
    """Make ``workdir`` the demo's: create it, or take it if empty (writing an empty record first, so that a demo
    killed half-way can run again) or if it holds the record of an earlier demo, which is returned (None when
    there was none, or it is unreadable). A folder with other files and no record is refused, untouched."""
    record = workdir / RECORD
    if record.is_file():
        return read_json(record)
    workdir.mkdir(parents=True, exist_ok=True)
    if any(workdir.iterdir()):
        raise DemoError(f"{workdir} holds files and no {RECORD}, so mmidx demo did not make it (or a demo older "
                        "than its record did): give a new or empty folder as --workdir; the demo never writes "
                        "into a folder of yours")
    write_json(record, {"format": _RECORD_FORMAT, "spec": None, "files": {}})
    return None


def corpus_unchanged(workdir: Path, spec: CorpusSpec, last: dict[str, Any] | None) -> bool:
    """Whether ``workdir/raw`` holds the corpus of ``spec`` as the last run generated it: ``last`` (its record)
    names ``spec`` and every file it lists still has its bytes."""
    files = _recorded_files(last)
    return bool(files) and last.get("spec") == asdict(spec) and \
        all(_sha256(workdir / name) == sha256 for name, sha256 in files.items())


def generate_corpus(workdir: Path, spec: CorpusSpec, last: dict[str, Any] | None) -> None:
    """Generate the corpus of ``spec`` in ``workdir/raw``, remove the files of the last corpus (``last``, its
    record) that the new one does not hold, and record the new one."""
    raw = workdir / "raw"
    write_corpus(raw, spec)
    generated = json.loads((raw / "meta.json").read_text())["files"]
    written = {f"raw/{name}": _sha256(raw / name) for name in generated}
    for name in set(_recorded_files(last)) - set(written):
        path = (workdir / name).resolve()
        if path.is_relative_to(raw.resolve()):  # the last corpus's files only: never a path a record points out of
            path.unlink(missing_ok=True)
    write_json(workdir / RECORD, {"format": _RECORD_FORMAT, "spec": asdict(spec), "files": written})


def _recorded_files(record: dict[str, Any] | None) -> dict[str, str]:
    """The files (name under the demo's folder → sha256) a record of this format lists; none for any other."""
    if not record or record.get("format") != _RECORD_FORMAT or not isinstance(record.get("files"), dict):
        return {}
    return {name: sha256 for name, sha256 in record["files"].items() if isinstance(sha256, str)}


def _sha256(path: Path) -> str | None:
    """The sha256 of a file's bytes; None if it cannot be read (then the corpus is generated again)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def format_summary(result: dict[str, Any]) -> str:
    """The human-readable summary of :func:`run`."""
    t, index, stats = result["timings"], result["index"], result["index"].stats
    lines = [f"mmidx demo in {result['workdir']}: build → index → packed batches on generated BAGEL-style data",
             f"  generate  t2i/edit parquet, vlm JSONL + images + videos, BPE tokenizer   {t['generate']:.1f} s"]
    built = ", ".join(f"{Path(r.data['output']).name} {r.data['samples']:,} samples "
                      f"({r.data['skipped']:,} skipped)" for r in result["reports"])
    lines.append(f"  build     {built}   {t['build']:.1f} s")
    lines.append(f"  index     {stats['samples']:,} samples → {stats['num_packs']:,} packs, fill "
                 f"{stats['fill_vs_max']:.1%} of {index.config.packing.max_num_tokens:,} tokens, "
                 f"{stats['excluded']} excluded, {stats['deferred']} deferred   {t['index']:.2f} s")
    rate = result["tokens"] / t["batches"] if t["batches"] else 0.0
    lines.append(f"  batches   {result['packs']} packs, {result['tokens']:,} tokens, "
                 f"{result['bytes'] / result['packs'] / 1e6:.0f} MB/pack: {rate:,.0f} tokens/s "
                 f"(one thread, images decoded and transformed)")
    dense = result["dense_masks"]
    lines.append(f"  masks     pack 0: BlockMask {t['block_mask'] * 1e3:.0f} ms; dense {len(dense)} masks "
                 f"({sum(m.numel() for m in dense) * 4 / 1e6:.0f} MB) {t['dense_masks'] * 1e3:.0f} ms")
    lines.append(f"  verify    {'all datasets OK' if not result['problems'] else result['problems']}")
    data_yaml = Path(result["workdir"]) / "datasets" / "data.yaml"
    lines.append(f"  next      mmidx inspect {result['reports'][0].data['output']}")
    lines.append(f"            mmidx show {data_yaml} --pack 0 -o pack.png")
    return "\n".join(lines)
