"""The multimodal pack index of a data config: which samples (and views) make pack k.

Built once per job from the datasets' index arrays alone, never decoding an image:

1. every view's exact packed size (BAGEL's ``num_tokens + 2 × len(plan)``): text lengths from the
   token index, image token counts from the probed sizes and the group's transforms;
2. the blended, shuffled stream of (group, sample, epoch) (:func:`mmidx.index.multimodal_stream`):
   epoch e of a sample reads its view ``e mod views`` (stored per stream item);
3. packs of whole samples within the budgets (:func:`mmidx.index.pack_samples`).

The arrays are cached (:mod:`mmidx.cache`) under a hash of the config, the requested size and every
dataset's checksum, and loaded with mmap; under ``torch.distributed`` rank 0 builds them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx.cache import cached_arrays
from mmidx.config import DataConfig, GroupConfig, ModelGeometry
from mmidx.dataset import MMIDXDataset
from mmidx.images import num_image_tokens
from mmidx.index import multimodal_stream, pack_samples, stream_views
from mmidx.packing import PackItem

INDEX_VERSION = 1


def view_token_counts(dataset: MMIDXDataset, group: GroupConfig,
                      geometry: ModelGeometry) -> tuple[np.ndarray, np.ndarray]:
    """(view_offsets, view_tokens): the views of sample s are ``view_tokens[view_offsets[s]:view_offsets[s+1]]``.

    Each view's size counts every element's tokens plus its two framing tokens, as BAGEL's packer
    estimates a sample (``num_tokens + 2 * len(sequence_plan)``); it is exact when nothing is dropped.
    """
    dataset.check_structure()  # everything below indexes with the index arrays
    tokens = dataset.tokens
    lengths = tokens.sequence_lengths.astype(np.int64)
    documents = tokens.document_indices
    plan = dataset.plan
    if plan is None:  # text datasets: one view, one loss-bearing text element per sequence
        cumulative = np.concatenate([[0], np.cumsum(lengths + 2)])
        return np.arange(len(dataset) + 1, dtype=np.int64), np.diff(cumulative[documents])
    elements = plan["elements"]
    view_offsets = plan["sample_view_offsets"].astype(np.int64)
    element_offsets = plan["view_element_offsets"].astype(np.int64)
    sample_of_element = dataset.element_samples()
    counts = np.full(len(elements), 2, dtype=np.int64)
    kind = elements["kind"]
    payload = elements["payload"].astype(np.int64)
    is_text = kind == fmt.TEXT
    counts[is_text] += lengths[documents[sample_of_element[is_text]] + payload[is_text]]
    images = plan["sample_image_offsets"][sample_of_element] + payload
    info = plan["image_info"]
    for code, transform, patch in ((fmt.VAE_IMAGE, group.vae_transform, geometry.vae_image_downsample),
                                   (fmt.VIT_IMAGE, group.vit_transform, geometry.vit_patch_size)):
        selected = kind == code
        if not selected.any():
            continue
        if transform is None:
            raise ValueError(f"group {group.name!r}: {dataset.prefix} has {fmt.KIND_NAMES[code]} elements but "
                             "the group has no image_transform_args")
        number = images[selected]
        counts[selected] += num_image_tokens(info["width"][number], info["height"][number], transform,
                                             img_nums=elements["img_num"][selected], patch_size=patch)
    cumulative = np.concatenate([[0], np.cumsum(counts)])
    return view_offsets, np.diff(cumulative[element_offsets])


@dataclass
class PackIndex:
    """Loaded (memory-mapped) pack index: ``len()`` packs, ``items(k)`` → the samples of pack k."""

    config: DataConfig
    arrays: dict[str, np.ndarray]
    stats: dict[str, Any]
    group_offsets: list[np.ndarray]  # per group: cumulative dataset sizes, to map group samples to datasets
    path: Path | None = None

    def __len__(self) -> int:
        return len(self.arrays["pack_offsets"]) - 1

    def items(self, pack: int) -> list[PackItem]:
        """The samples of pack ``pack`` in packing order, each with the view its epoch reads."""
        if not 0 <= pack < len(self):
            raise IndexError(f"pack {pack} out of range for {len(self)} packs")
        offsets = self.arrays["pack_offsets"]
        positions = self.arrays["pack_items"][offsets[pack]:offsets[pack + 1]]
        items = []
        for position in positions.tolist():
            group = int(self.arrays["stream_group"][position])
            sample = int(self.arrays["stream_sample"][position])
            view = int(self.arrays["stream_view"][position])
            bounds = self.group_offsets[group]
            dataset = int(np.searchsorted(bounds, sample, side="right")) - 1
            items.append(PackItem(group, dataset, sample - int(bounds[dataset]), view))
        return items


def build_pack_index(config: DataConfig, *, num_samples: int | None = None,
                     cache_dir: str | os.PathLike | None = None) -> PackIndex:
    """Build (or load from ``cache_dir``) the pack index of ``config``.

    ``num_samples``: stream length (samples drawn across all groups and epochs); default: the
    total number of samples of all groups, i.e. about one epoch. Cached arrays are reused only if
    the config, the size and every dataset are unchanged.
    """
    datasets = [[MMIDXDataset(prefix) for prefix in group.datasets] for group in config.groups]
    group_sizes = [sum(len(d) for d in group) for group in datasets]
    if min(group_sizes) == 0:
        empty = {g.name: g.datasets for g, n in zip(config.groups, group_sizes, strict=True) if n == 0}
        raise ValueError(f"groups {empty} have no samples")
    num_samples = sum(group_sizes) if num_samples is None else int(num_samples)
    group_offsets = [np.concatenate([[0], np.cumsum([len(d) for d in group])]).astype(np.int64)
                     for group in datasets]
    checksums = [[d.checksum for d in group] for group in datasets]
    description = {"kind": "pack_index", "version": INDEX_VERSION, "config": config.describe(),
                   "num_samples": num_samples, "datasets": checksums}
    arrays, stats, folder = cached_arrays(
        cache_dir, description, lambda: _build_arrays(config, datasets, group_sizes, num_samples))
    return PackIndex(config, arrays, stats, group_offsets, folder)


def _build_arrays(config: DataConfig, datasets: list[list[MMIDXDataset]], group_sizes: list[int],
                  num_samples: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    start = time.perf_counter()
    view_offsets, view_tokens = [], []
    for group, group_datasets in zip(config.groups, datasets, strict=True):
        offsets_parts, token_parts, base = [np.zeros(1, np.int64)], [], 0
        for dataset in group_datasets:
            offsets, tokens = view_token_counts(dataset, group, config.geometry)
            offsets_parts.append(offsets[1:] + base)
            token_parts.append(tokens)
            base += int(offsets[-1])
        view_offsets.append(np.concatenate(offsets_parts))
        view_tokens.append(np.concatenate(token_parts))
    weights = np.array([g.weight for g in config.groups], dtype=np.float64)
    stream_group, stream_sample, stream_epoch = multimodal_stream(group_sizes, weights, num_samples, config.seed)
    stream_view, stream_tokens = stream_views(stream_group, stream_sample, stream_epoch, view_offsets,
                                              view_tokens)
    packing = config.packing
    result = pack_samples(stream_tokens, stream_group.astype(np.int32),
                          mandatory=np.array([g.is_mandatory for g in config.groups]),
                          max_num_tokens=packing.max_num_tokens, expected_num_tokens=packing.expected_num_tokens,
                          max_num_tokens_per_sample=packing.max_num_tokens_per_sample,
                          prefer_buffer_before=packing.prefer_buffer_before, max_buffer_size=packing.max_buffer_size)
    arrays = {"stream_group": stream_group, "stream_sample": stream_sample, "stream_view": stream_view,
              "stream_tokens": stream_tokens, "pack_offsets": result.pack_offsets, "pack_items": result.pack_items,
              "excluded": result.excluded}
    stats = {**{k: (v.item() if hasattr(v, "item") else v) for k, v in result.stats.items()},
             "samples": len(stream_group), "groups": {g.name: int(np.count_nonzero(stream_group == i))
                                                          for i, g in enumerate(config.groups)},
             "tokens": int(result.pack_tokens.sum()), "build_seconds": round(time.perf_counter() - start, 3)}
    return arrays, stats
