"""Every key of every packed batch of mmidx against BAGEL's own code, on the same samples, views and draws.

    python tools/check_bagel.py --bagel-src DIR [--bagel-site DIR] [--packs 10] [--modes t2i,edit,vlm,mix]

DIR is a checkout of ByteDance-Seed/Bagel fetched by the user (never part of this repository); its ``data`` package
is imported unmodified, and ``--bagel-site`` holds its extra packages for a CPU-only torch (see
benchmarks/bagel_peer.py). On the generated corpus of bench_pack.py (built once under ``--workdir``), for each
mode and each of the first ``--packs`` packs of mmidx's pack index:

* every sample of the pack is made again by BAGEL's own per-row code from the raw file and row mmidx built it from:
  ``T2IIterableDataset`` (parquet row, ``pil_img2rgb``, its ``ImageTransform``, ``tokenizer.encode``),
  ``UnifiedEditIterableDataset.parse_row`` and ``SftJSONLIterableDataset`` (one JSONL line), each through its
  ``__iter__`` started at that row. BAGEL's per-row random draws are mmidx's: the t2i caption ``random.choice``
  returns the caption of mmidx's view, and edit's ``random`` is mmidx's generator of that row (seeded by (seed,
  file, row)), called once per view up to the view packed; which rows a pack holds (BAGEL's shuffles and group
  draws) is mmidx's pack index;
* the sequence plans are compared element by element;
* BAGEL's ``PackedDataset.pack_sequence`` packs them in order, its ``random.random()`` (CFG dropout) and
  ``np.random.randn()`` (timesteps) answering mmidx's Philox draws for that (seed, pack, position, element); then
  its ``to_tensor``; flex and dense;
* every key of the result is compared with mmidx's ``PackBuilder.build(k, items).to_dict()``: tensors by dtype,
  shape and value (bit for bit), lists by equality. The README's deliberate differences (e.g. an empty
  ``mse_loss_indexes`` is int64 in mmidx) are counted apart; ``batch_data_indexes`` is mmidx's own record of
  (group, dataset, sample, view) and is not compared.

Prints the comparisons made, each mismatch (mode, pack, key, detail), the deliberate differences met and BAGEL's
commit; exits 1 on any mismatch, 2 when BAGEL cannot be imported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
import types
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bagel_peer import BUDGETS, DROPOUT, GEOMETRY, MODES, bagel_commit, import_bagel, packed_dataset, prepare
from bagel_rows import BagelSamples, NotBagels
from common import commit

from mmidx.config import DataConfig
from mmidx.index.dropout import sample_randomness
from mmidx.index.pack_index import PackItem, build_pack_index
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset

PLAN_KEYS = ("type", "enable_cfg", "loss", "special_token_loss", "special_token_label", "split_start", "split_end",
             "frame_delta")


class IndexedPlan(list):
    """A sequence plan that remembers which element ``pack_sequence``'s loop is at, so that its draws can answer
    that element's."""

    cursor = -1

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for index, item in enumerate(list.__iter__(self)):
            self.cursor = index
            yield item


@contextlib.contextmanager
def mmidx_draws(dataset_base: Any, plan: IndexedPlan, uniforms: Any, normals: Any) -> Iterator[None]:
    """``pack_sequence``'s ``random.random()`` and ``np.random.randn()`` answering mmidx's draws of the element its
    loop is at."""
    uniform = types.SimpleNamespace(random=lambda: float(uniforms[plan.cursor]))
    normal = types.SimpleNamespace(random=types.SimpleNamespace(randn=lambda: float(normals[plan.cursor])))
    with mock.patch.object(dataset_base, "random", uniform), mock.patch.object(dataset_base, "np", normal):
        yield


def compare_plans(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str | None:
    """What differs between mmidx's plan and BAGEL's (BAGEL's defaults for keys it leaves out), or None."""
    if len(ours) != len(theirs):
        return f"{len(ours)} elements in mmidx's plan, {len(theirs)} in BAGEL's"
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for key in PLAN_KEYS:
            mine = a.get(key)
            default = True if key in ("split_start", "split_end") else None
            if (mine if mine is not None else default) != b.get(key, default):
                return f"element {index} {key}: mmidx {mine!r}, BAGEL {b.get(key, default)!r}"
    return None


def difference(key: str, ours: Any, theirs: Any) -> str | None:
    """What differs between two values of a batch key (bit for bit for tensors), or None."""
    if isinstance(theirs, torch.Tensor):
        if not isinstance(ours, torch.Tensor):
            return f"mmidx gives {type(ours).__name__}, BAGEL a tensor"
        if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
            return f"mmidx {ours.dtype} {tuple(ours.shape)}, BAGEL {theirs.dtype} {tuple(theirs.shape)}"
        if not torch.equal(ours, theirs):
            unequal = (ours != theirs) & ~(ours.isnan() & theirs.isnan()) if ours.is_floating_point() \
                else ours != theirs
            where = unequal.nonzero()
            if len(where) == 0:
                return None
            first = tuple(where[0].tolist())
            return f"{len(where)} of {ours.numel()} values differ, first at {first}: mmidx {ours[first].item()}, " \
                   f"BAGEL {theirs[first].item()}"
        return None
    if isinstance(theirs, list) and theirs and isinstance(theirs[0], torch.Tensor):
        if not isinstance(ours, list) or len(ours) != len(theirs):
            return f"mmidx gives {len(ours) if isinstance(ours, list) else type(ours).__name__} items, " \
                   f"BAGEL {len(theirs)}"
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            detail = difference(key, a, b)
            if detail:
                return f"item {index}: {detail}"
        return None
    normalise = (lambda v: [tuple(x) if isinstance(x, list | tuple) else x for x in v]) \
        if isinstance(theirs, list) else (lambda v: v)
    if normalise(ours) != normalise(theirs):
        return f"mmidx {str(ours)[:120]}, BAGEL {str(theirs)[:120]}"
    return None


def deliberate(key: str, ours: Any, theirs: Any) -> str | None:
    """The README's deliberate difference this one is, if it is one ("BAGEL semantics, and where mmidx differs on
    purpose")."""
    if key == "mse_loss_indexes" and isinstance(ours, torch.Tensor) and ours.numel() == theirs.numel() == 0 \
            and ours.dtype == torch.int64:
        return "an empty mse_loss_indexes is int64 (BAGEL's is float32, which cannot index)"
    return None


class Tally:
    """Comparisons made, mismatches and deliberate differences met."""

    def __init__(self) -> None:
        self.comparisons, self.mismatches, self.deliberate = 0, [], Counter()
        self.batches, self.plans, self.videos = 0, 0, 0  # packed batches, sample plans, video samples compared

    def check(self, where: str, key: str, ours: Any, theirs: Any) -> None:
        self.comparisons += 1
        detail = difference(key, ours, theirs)
        if detail is None:
            return
        reason = deliberate(key, ours, theirs)
        if reason:
            self.deliberate[reason] += 1
        else:
            self.mismatches.append(f"{where} {key}: {detail}")

    def fail(self, where: str, what: str, detail: str) -> None:
        self.comparisons += 1
        self.mismatches.append(f"{where} {what}: {detail}")


def check_mode(mode: str, raw: Path, datasets: Path, packs: int, tally: Tally) -> int:
    """Compare the first ``packs`` packs of ``mode``, flex and dense; returns the number of packs compared."""
    import data.dataset_base as dataset_base

    groups = MODES["vlm" if mode == "video" else mode]
    spec = yaml.safe_load((datasets / "data.yaml").read_text())
    config = DataConfig.from_dict({"groups": {g: spec["groups"][g] for g in groups}, "packing": BUDGETS,
                                   "dropout": DROPOUT, "geometry": GEOMETRY}, base_dir=datasets)
    index = build_pack_index(config, num_samples=packs * 40)
    packs = min(packs, len(index) - 1)  # the last pack may be partial
    opened = {(g, d): MMIDXDataset(prefix) for g, group in enumerate(config.groups)
              for d, prefix in enumerate(group.datasets)}
    seeds = {key: ((ds.metadata or {}).get("build") or {}).get("options", {}).get("seed", 0)
             for key, ds in opened.items()}
    builders = {flex: PackBuilder(config, use_flex=flex) for flex in (True, False)}
    packed = packed_dataset(raw, groups, use_flex=True)
    makers = BagelSamples(packed, groups)
    for k in range(packs):
        items: list[PackItem] = index.items(k)
        where = f"{mode} pack {k}"
        samples = []
        try:
            for position, item in enumerate(items):
                sample = opened[item.group, item.dataset][item.sample]
                made = makers.make(groups[item.group], sample, item.view, seeds[item.group, item.dataset])
                plan = sample.sequence_plan(item.view)
                detail = compare_plans(plan, made["sequence_plan"])
                tally.comparisons += 1
                tally.plans += 1
                if detail:
                    raise NotBagels(f"sample {position} ({groups[item.group]} {item.sample} view {item.view}) "
                                    f"plan: {detail}")
                samples.append((made, sample_randomness(config.seed, k, position, len(plan))))
        except NotBagels as error:
            tally.fail(where, "samples", str(error))
            continue
        for flex, builder in builders.items():
            ours = builder.build(k, items).to_dict()
            packed.use_flex = flex
            status = packed.set_sequence_status()
            for made, (uniforms, normals) in samples:
                bagel_sample = {key: list(value) if isinstance(value, list) else value for key, value in made.items()}
                bagel_sample["sequence_plan"] = plan = IndexedPlan(made["sequence_plan"])
                with mmidx_draws(dataset_base, plan, uniforms, normals):
                    status = packed.pack_sequence(bagel_sample, status)
            theirs = packed.to_tensor(status)
            label = f"{where} {'flex' if flex else 'dense'}"
            tally.batches += 1
            keys = (set(ours) - {"batch_data_indexes"}) | set(theirs)
            for key in sorted(keys):
                if key not in ours or key not in theirs:
                    tally.fail(label, key, f"only in {'mmidx' if key in ours else 'BAGEL'}'s batch")
                else:
                    tally.check(label, key, ours[key], theirs[key])
    tally.videos += makers.videos
    return packs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bagel-src", required=True, help="checkout of ByteDance-Seed/Bagel (its data package)")
    parser.add_argument("--bagel-site", help="folder with torchvision, decord, cv2 for BAGEL (see bagel_peer.py)")
    parser.add_argument("--bagel-commit", help="BAGEL's commit, when --bagel-src has no .git")
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-pack", help="generated corpus and datasets (shared "
                                                                           "with bench_pack.py)")
    parser.add_argument("--packs", type=int, default=10, help="packs compared per mode (each in flex and dense)")
    parser.add_argument("--modes", default="t2i,edit,vlm,mix,video",
                        help="video: vlm on a corpus with video clips (every eighth conversation)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        import_bagel(args.bagel_src, args.bagel_site)
    except ImportError as error:
        print(f"check_bagel: cannot import BAGEL's data package from {args.bagel_src} ({error}); pass its checkout "
              "as --bagel-src and its extra packages as --bagel-site (see benchmarks/bagel_peer.py)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    tally, packs = Tally(), {}
    for mode in args.modes.split(","):
        raw, datasets = prepare(Path(args.workdir), videos=mode == "video")
        packs[mode] = check_mode(mode, raw, datasets, args.packs, tally)
        print(f"# {mode}: {packs[mode]} packs, flex and dense; {tally.comparisons} comparisons so far, "
              f"{len(tally.mismatches)} mismatches", flush=True)
    for line in tally.mismatches:
        print(f"MISMATCH {line}")
    for reason, count in tally.deliberate.items():
        print(f"deliberate difference ({count}×): {reason}")
    command = " ".join(["python", "tools/check_bagel.py", *map(shlex.quote, sys.argv[1:])])
    print(f"check_bagel: {tally.comparisons} comparisons ({tally.batches} packed batches key by key: "
          f"{', '.join(f'{m} {n} packs' for m, n in packs.items())}, each flex and dense; {tally.plans} sample "
          f"plans, {tally.videos} of them video clips), {len(tally.mismatches)} mismatches, "
          f"{sum(tally.deliberate.values())} deliberate differences; mmidx commit {commit()}, BAGEL commit "
          f"{bagel_commit(args.bagel_src, args.bagel_commit)}; {time.perf_counter() - start:.0f} s, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"# command: {command}")
    return 1 if tally.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
