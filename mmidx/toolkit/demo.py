"""``mmidx demo``: the whole path on generated data — build → index → packed batches — with a summary.

Generates a small BAGEL-format corpus (:mod:`mmidx.toolkit.synthetic`), builds one mmidx dataset per
group of a BAGEL-style data YAML (t2i, edit, vlm with a few videos), builds the pack index,
iterates every pack through the torch loader, builds the attention masks of one pack both ways,
verifies every dataset, and prints what happened and how fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

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


STEPS = {"generate": "generating a BAGEL-format corpus", "build": "building one dataset per group",
         "index": "building the pack index", "batches": "iterating every pack through the torch loader",
         "block_mask": "building pack 0's BlockMask", "dense_masks": "building pack 0's dense masks",
         "verify": "verifying every dataset"}


def run(workdir: str | Path, *, quick: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the demo in ``workdir`` and return its summary; ``progress`` is told of each step as it starts."""
    from mmidx.config import DataConfig
    from mmidx.index.pack_index import build_pack_index
    from mmidx.ingest import build_from_config
    from mmidx.pack.builder import PackBuilder
    from mmidx.read.checks import verify
    from mmidx.toolkit.synthetic import CorpusSpec, write_corpus
    from mmidx.train.loader import PackDataset, PackLoader

    workdir = Path(workdir).resolve()  # the dataset info below names absolute paths
    timings: dict[str, float] = {}

    def step(label: str) -> None:
        if progress is not None:
            progress(f"[{list(STEPS).index(label) + 1}/{len(STEPS)}] {STEPS[label]}...")

    def timed(label: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        step(label)
        start = time.perf_counter()
        result = function(*args, **kwargs)
        timings[label] = time.perf_counter() - start
        return result

    spec = CorpusSpec(t2i_rows=8, edit_rows=4, vlm_lines=16, vlm_images=8, vlm_videos=1) if quick else \
        CorpusSpec(vlm_videos=2)
    raw = timed("generate", write_corpus, workdir / "raw", spec)
    (workdir / "bagel.yaml").write_text(yaml.safe_dump(BAGEL_GROUPS, sort_keys=False))
    (workdir / "dataset_info.yaml").write_text(yaml.safe_dump({
        "t2i_pretrain": {"t2i": {"data_dir": str(raw / "t2i")}},
        "unified_edit": {"seedxedit_multi": {"data_dir": str(raw / "editing" / "seedxedit_multi")}},
        "vlm_sft": {"llava_ov": {"data_dir": str(raw / "vlm" / "images"),
                                 "jsonl_path": str(raw / "vlm" / "sft.jsonl")}},
    }))
    reports = timed("build", build_from_config, workdir / "bagel.yaml", workdir / "dataset_info.yaml",
                     workdir / "datasets", tokenizer=str(raw / "tokenizer"), workers=2, progress=False)
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
