"""``mmidx bench``: how fast the real torch loader feeds packed batches here, and where the time goes.

For each worker count, :class:`~mmidx.train.loader.PackLoader` iterates packs of the config as a trainer
would (workers build batches; the main process receives them, moves them to the device, decodes
deferred images there and builds the masks), and the rates are timed from the first batch on, so
worker start-up is left out. Then one process builds the same packs with a stage clock
(:class:`StageClock`) attached to :class:`~mmidx.pack.builder.PackBuilder`, which splits a pack's time
into read, decode, resize+normalise/patchify (one fused kernel), assemble and masks; from its rate
follows the number of loader cores a given tokens/s needs. Text-only datasets get Megatron GPT samples/s instead.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from mmidx.config import DataConfig
from mmidx.read.dataset import MMIDXDataset

STAGES = ("read", "decode", "normalise", "assemble", "masks")
# one fused kernel resizes and normalises/patchifies (mmidx._pixels), so they are one stage
STAGE_LABELS = {"normalise": "resize+normalise/patchify"}
MASKS = ("none", "dense", "flex")


def machine(*packages: str) -> str:
    """CPU model and cores, Python, and the versions of the named installed distributions."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = []
    for name in packages:
        try:
            versions.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    return ", ".join([f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}", *versions])


class StageClock:
    """Exclusive seconds per stage: time spent in a nested stage is not counted in the one around it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # per open stage: seconds its nested stages took

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[stage] += elapsed - self._inner.pop()
            if self._inner:
                self._inner[-1] += elapsed


def batch_bytes(batch: Any) -> int:
    """Bytes a batch carries from a loader worker: its tensors, and deferred images' encoded bytes."""
    total = sum(t.numel() * t.element_size() for t in batch.tensors.values() if isinstance(t, torch.Tensor))
    if batch.deferred is not None:
        total += sum(data.numel() for data in batch.deferred.encoded)
    return total


def _finish(batch: Any, masks: str, device: str) -> Any:
    """What the trainer's process does with a received batch: move (decoding deferred images), build masks."""
    batch = batch.to(device, non_blocking=device.startswith("cuda"))  # pinned by the loader there: asynchronous
    if masks != "none":
        batch.attention_masks()
    _synchronize(device)
    return batch


def _synchronize(device: str) -> None:
    """Wait for the device's queued work, so that its time is counted where it was asked for."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def pack_index_holding(config: DataConfig, packs: int, cache_dir: str | os.PathLike | None) -> Any:
    """A pack index with more than ``packs`` packs (the last may be partial): the stream is lengthened past
    one epoch, doubling, until it holds them."""
    from mmidx.index.pack_index import build_pack_index

    index = build_pack_index(config, cache_dir=cache_dir)
    samples = index.stats["samples"]
    while len(index) <= packs:
        if len(index) == 0:
            raise ValueError("the pack index holds no pack (is every sample over max_num_tokens_per_sample?): "
                             "nothing to time")
        samples *= 2
        index = build_pack_index(config, num_samples=samples, cache_dir=cache_dir)
    return index


def bench_packs(config: DataConfig, *, packs: int = 20, workers: Sequence[int] = (0, 1, 2, 4),
                decode: str = "loader", masks: str = "flex", target_tokens_per_s: float = 100_000,
                device: str | None = None, cache_dir: str | os.PathLike | None = None,
                encodings: str | None = None) -> dict[str, Any]:
    """Loader throughput per worker count, one process's stage breakdown, and the cores ``target_tokens_per_s`` needs.

    ``encodings`` (a precached VAE encoding's name): the same again with packs carrying its latents
    (``padded_latent``) instead of pixels, under ``result["latents"]``.

    ``masks``: "none" (split metadata only), "dense" (per-sample masks) or "flex" (a BlockMask),
    built in the main process on ``device`` (default: CUDA if available, else the CPU).
    """
    if masks not in MASKS:
        raise ValueError(f"masks is one of {', '.join(MASKS)}, not {masks!r}")
    if packs < 2:
        raise ValueError(f"time at least 2 packs (the first is not timed), not {packs}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    index = pack_index_holding(config, packs, cache_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a loader worker: per-core figures, and the table's rows comparable
    try:
        result = _bench_packs(config, index, packs, workers, decode, masks, target_tokens_per_s, device, None)
        if encodings:
            result["latents"] = {"name": encodings, **_bench_packs(config, index, packs, workers, decode, masks,
                                                                   target_tokens_per_s, device, {"vae": encodings})}
        return result
    finally:
        torch.set_num_threads(threads)


def _bench_packs(config: DataConfig, index: Any, packs: int, workers: Sequence[int], decode: str, masks: str,
                 target_tokens_per_s: float, device: str, encodings: dict[str, str] | None) -> dict[str, Any]:
    from mmidx.pack.builder import PackBuilder
    from mmidx.train.loader import PackDataset, PackLoader

    builder = PackBuilder(config, use_flex=masks != "dense", decode_images=decode, encodings=encodings)
    rows = []
    for count in workers:
        loader = PackLoader(PackDataset(index, builder), global_batch_size=1, num_workers=count,
                            pin_memory=device.startswith("cuda"))
        received, tokens, samples, nbytes, start = 0, 0, 0, 0, 0.0
        batches = iter(loader)
        try:
            for batch in batches:
                if received:  # the first batch (and the workers' start-up) is not timed
                    tokens += batch.sequence_length
                    samples += len(batch.sample_lens)
                    nbytes += batch_bytes(batch)
                _finish(batch, masks, device)
                received += 1
                if received == 1:
                    start = time.perf_counter()
                if received == packs:
                    break
            seconds = time.perf_counter() - start
        finally:
            batches.close()  # stop the workers now, not whenever the suspended generator is collected
        timed = received - 1
        rows.append({"workers": count, "packs": timed, "seconds": seconds, "packs_per_s": timed / seconds,
                     "tokens_per_s": tokens / seconds, "samples_per_s": samples / seconds,
                     "mb_per_s": nbytes / seconds / 1e6, "bytes_per_pack": nbytes / timed})
    stages = _stage_breakdown(config, index, packs, decode, masks, device, encodings)
    one_core = stages["tokens_per_s"]
    return {"kind": "packs", "machine": machine("torch", "Pillow", "numpy"), "device": device, "decode": decode,
            "masks": masks, "pin_memory": device.startswith("cuda"), "non_blocking": device.startswith("cuda"),
            "num_packs": len(index), "max_num_tokens": config.packing.max_num_tokens,
            "packing_policy": config.packing.policy, "fill_vs_max": index.stats["fill_vs_max"],
            "rows": rows, "stages": stages, "target_tokens_per_s": target_tokens_per_s,
            "cores_needed": math.ceil(target_tokens_per_s / one_core) if one_core else None,
            "torch_threads": torch.get_num_threads()}


def _stage_breakdown(config: DataConfig, index: Any, packs: int, decode: str, masks: str,
                     device: str, encodings: dict[str, str] | None = None) -> dict[str, Any]:
    """Build packs 1..packs-1 in this process with a :class:`StageClock`: ms per pack and share per stage."""
    from mmidx.pack.builder import PackBuilder

    clock = StageClock()
    builder = PackBuilder(config, use_flex=masks != "dense", decode_images=decode, stage=clock, encodings=encodings)
    _finish(builder.build(0, index.items(0)), masks, device)  # warm caches, as the table's first pack
    clock.seconds.clear()
    tokens, start = 0, time.perf_counter()
    for k in range(1, packs):
        with clock("assemble"):
            batch = builder.build(k, index.items(k))
        tokens += batch.sequence_length
        with clock("decode" if decode == "device" else "assemble"):  # device decoding happens on the move
            batch = batch.to(device)
            _synchronize(device)
        if masks != "none":
            with clock("masks"):
                batch.attention_masks()
                _synchronize(device)
    seconds = time.perf_counter() - start
    timed = packs - 1
    ms = {stage: clock.seconds.get(stage, 0.0) * 1e3 / timed for stage in STAGES}
    total = sum(ms.values())
    return {"packs": timed, "ms_per_pack": ms, "share": {s: v / total if total else 0.0 for s, v in ms.items()},
            "total_ms_per_pack": total, "tokens_per_s": tokens / seconds}


def _samples(batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """GPT samples as they come: ``cu_seqlens`` differs in length from sample to sample, so no stacking."""
    return batch


def bench_gpt(prefixes: Sequence[str], *, seq_length: int = 2048, samples: int = 2000,
              workers: Sequence[int] = (0, 1, 2, 4), batch_size: int = 8) -> dict[str, Any]:
    """Megatron GPT samples/s of text datasets through a torch DataLoader, per worker count."""
    from mmidx.train.gpt import GPTTextDataset

    rows = []
    for prefix in prefixes:
        dataset = GPTTextDataset(prefix, seq_length=seq_length)
        wanted = min(samples, len(dataset))
        if wanted < 2 * batch_size:
            raise ValueError(f"{prefix}: {wanted} GPT samples of {seq_length} tokens to time, fewer than two batches "
                             f"of {batch_size} (the first is not timed): lower --seq-length or raise --gpt-samples")
        subset = torch.utils.data.Subset(dataset, range(wanted))
        for count in workers:
            loader = torch.utils.data.DataLoader(subset, batch_size=batch_size, num_workers=count,
                                                 collate_fn=_samples)
            received, nbytes, start = 0, 0, 0.0
            for i, batch in enumerate(loader):
                if i == 0:
                    start = time.perf_counter()
                    continue
                received += len(batch)
                nbytes += sum(t.numel() * t.element_size() for sample in batch for t in sample.values())
            seconds = max(time.perf_counter() - start, 1e-9)
            rows.append({"dataset": prefix, "workers": count, "samples": received,
                         "samples_per_s": received / seconds, "tokens_per_s": received * seq_length / seconds,
                         "mb_per_s": nbytes / seconds / 1e6})
    return {"kind": "gpt", "machine": machine("torch", "numpy"), "seq_length": seq_length,
            "batch_size": batch_size, "rows": rows}


def text_only(config: DataConfig) -> bool:
    """Whether every dataset of the config is a text dataset (then GPT samples are what a trainer reads)."""
    return all(MMIDXDataset(prefix).kind == "text" for group in config.groups for prefix in group.datasets)


def format_report(result: dict[str, Any]) -> str:
    """The table a person pastes: one row per worker count, then the stage breakdown and the cores needed."""
    if result["kind"] == "gpt":
        lines = [f"# mmidx bench — Megatron GPT samples of {result['seq_length']:,} tokens, "
                 f"batches of {result['batch_size']}", f"# {result['machine']}",
                 f"{'dataset':<32} {'workers':>7} {'samples/s':>10} {'tokens/s':>12} {'MB/s':>8}"]
        lines += [f"{os.path.basename(row['dataset']):<32} {row['workers']:>7} {row['samples_per_s']:>10,.0f} "
                  f"{row['tokens_per_s']:>12,.0f} {row['mb_per_s']:>8,.1f}" for row in result["rows"]]
        return "\n".join(lines)
    timed = result["rows"][0]["packs"] if result["rows"] else result["stages"]["packs"]
    lines = [f"# mmidx bench — {timed} packs timed per row (max {result['max_num_tokens']:,} tokens each, "
             f"{result['packing_policy']} packs filled to {result['fill_vs_max']:.1%} of it on average), "
             f"images decoded in the {result['decode']}, masks {result['masks']}, device {result['device']}, "
             f"{result['torch_threads']} torch thread{'s' if result['torch_threads'] != 1 else ''}",
             f"# {result['machine']}",
             f"{'workers':>7} {'packs/s':>8} {'tokens/s':>10} {'samples/s':>10} {'MB/s':>8} {'MB/pack':>8}"]
    for row in result["rows"]:
        lines.append(f"{row['workers']:>7} {row['packs_per_s']:>8.2f} {row['tokens_per_s']:>10,.0f} "
                     f"{row['samples_per_s']:>10,.1f} {row['mb_per_s']:>8,.0f} {row['bytes_per_pack'] / 1e6:>8.1f}")
    stages = result["stages"]
    lines.append(f"# one process, stage by stage ({stages['packs']} packs, {stages['tokens_per_s']:,.0f} tokens/s):")
    width = max(len(STAGE_LABELS.get(stage, stage)) for stage in STAGES)
    lines.append(f"{'stage':<{width}} {'ms/pack':>8} {'share':>6}")
    for stage in STAGES:
        lines.append(f"{STAGE_LABELS.get(stage, stage):<{width}} {stages['ms_per_pack'][stage]:>8.1f} "
                     f"{stages['share'][stage]:>6.1%}")
    lines.append(f"{'total':<{width}} {stages['total_ms_per_pack']:>8.1f}")
    if result["cores_needed"] is not None:
        lines.append(f"cores needed to feed {result['target_tokens_per_s']:,.0f} tokens/s: {result['cores_needed']} "
                     f"(at {stages['tokens_per_s']:,.0f} tokens/s per core, if workers scale linearly; "
                     "compare the rows above)")
    latents = result.get("latents")
    if latents:
        lines.append(f"# the same with precached latents ({latents['name']}: padded_latent instead of padded_images)")
        lines.append(f"{'workers':>7} {'packs/s':>8} {'tokens/s':>10} {'MB/pack':>8} {'× pixels':>9}")
        for row, pixels in zip(latents["rows"], result["rows"], strict=True):
            lines.append(f"{row['workers']:>7} {row['packs_per_s']:>8.2f} {row['tokens_per_s']:>10,.0f} "
                         f"{row['bytes_per_pack'] / 1e6:>8.1f} {row['tokens_per_s'] / pixels['tokens_per_s']:>9.2f}")
        one = latents["stages"]
        lines.append(f"# one process: {one['tokens_per_s']:,.0f} tokens/s with latents, "
                     f"{one['tokens_per_s'] / stages['tokens_per_s']:.1f}× the pixels' {stages['tokens_per_s']:,.0f}")
    lines.append("# read: sample lookup and plan records (image bytes are paged in by decode); assemble: token ids, "
                 "positions, indexes, tensors and the move to the device; masks: building the attention masks there")
    return "\n".join(lines)
