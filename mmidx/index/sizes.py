"""A view's packed size from a dataset's index arrays alone, never decoding an image: each element's tokens as the
pack builder writes them (a text's tokens, an image's patches or latents after its group's transform of the stored
size, two framing tokens each), summed per view for the pack index (exact when CFG dropout drops nothing), or kept
per element for the packs' sizes after dropout (:mod:`mmidx.index.pack_costs`).

Sizes are computed a part of the dataset at a time (its shards, :attr:`~mmidx.read.dataset.MMIDXDataset.parts`)
and within a part :data:`CHUNK_SAMPLES` samples at a time, so no temporary grows with the dataset: the one array
that does is the output, the view table (:func:`view_table`: 4 bytes a view, and 8 more a sample only when some
sample has more than one view).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from mmidx import format as fmt
from mmidx.config import DataConfig, GroupConfig, ModelGeometry
from mmidx.images.transform import ImageTransform, num_image_tokens
from mmidx.index.stream import ViewTable
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.shards import part_starts

# Samples sized at once: every per-element temporary (a few hundred bytes a sample) stays within tens of MB.
CHUNK_SAMPLES = 1 << 16
_VIEW_TOKENS_MAX = int(np.iinfo(np.int32).max)  # the view table holds int32 counts


def view_token_counts(dataset: MMIDXDataset, group: GroupConfig,
                      geometry: ModelGeometry) -> tuple[np.ndarray, np.ndarray]:
    """(view_offsets, view_tokens) of every sample of ``dataset``: the views of sample s are
    ``view_tokens[view_offsets[s]:view_offsets[s+1]]`` (whole arrays, int64: for reading a dataset's sizes whole;
    the pack index reads them through :func:`view_table`).

    Each view's size counts every element's tokens plus its two framing tokens, as BAGEL's packer
    estimates a sample (``num_tokens + 2 * len(sequence_plan)``); it is exact when nothing is dropped.
    """
    views, tokens = [], []
    for chunk_views, chunk_tokens in dataset_views(dataset, group, geometry):
        views.append(chunk_views)
        tokens.append(chunk_tokens)
    offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(np.concatenate(views), dtype=np.int64)])
    return offsets, np.concatenate(tokens).astype(np.int64)


def dataset_views(dataset: MMIDXDataset, group: GroupConfig, geometry: ModelGeometry,
                  selection: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The sizes of the samples ``selection`` of ``dataset`` (rising sample numbers, repeats allowed; None: every
    sample), a chunk at a time, in order: (views of each sample, packed tokens of each of their views, int64).

    Refuses (once every chunk is sized, naming the widest) an image whose patch grid is wider than the model's
    position table (:class:`_Grids`)."""
    dataset.check_structure()  # everything below indexes with the index arrays
    starts = part_starts(dataset)
    if selection is not None:
        selection = _checked(dataset, selection)
        bounds = np.searchsorted(selection, starts)
    grids = _Grids(dataset, group, geometry)
    parts = dataset.parts
    for number in range(len(starts) - 1):
        if selection is not None and bounds[number] == bounds[number + 1]:
            continue  # no sample of this part is used: it is not even opened
        part = parts[number].dataset
        chosen = None if selection is None else selection[bounds[number]:bounds[number + 1]] - starts[number]
        for first in range(0, len(part), CHUNK_SAMPLES):
            end = min(first + CHUNK_SAMPLES, len(part))
            if chosen is not None:
                low, high = np.searchsorted(chosen, (first, end))
                if low == high:
                    continue
            views, tokens = _chunk_views(part, group, geometry, first, end, grids, int(starts[number]))
            if chosen is not None:
                views, tokens = _picked(views, tokens, chosen[low:high] - first)
            yield views, tokens
    grids.check()


def _chunk_views(dataset: MMIDXDataset, group: GroupConfig, geometry: ModelGeometry, first: int, end: int,
                 grids: _Grids, base: int) -> tuple[np.ndarray, np.ndarray]:
    """(views of each sample, packed tokens of each view) of samples ``first .. end`` of ``dataset`` (one set of
    files, its structure checked), which are samples ``base + first ..`` of the dataset ``grids`` checks."""
    tokens, plan = dataset.tokens, dataset.plan
    if plan is None:  # text datasets: one view, one loss-bearing text element per sequence
        documents = np.asarray(tokens.document_indices[first:end + 1], dtype=np.int64)
        lengths = tokens.sequence_lengths[documents[0]:documents[-1]].astype(np.int64) + 2
        cumulative = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
        return np.ones(end - first, np.int64), np.diff(cumulative[documents - documents[0]])
    sample_views = np.asarray(plan["sample_view_offsets"][first:end + 1], dtype=np.int64)
    view_elements = np.asarray(plan["view_element_offsets"][sample_views[0]:sample_views[-1] + 1], dtype=np.int64)
    records = plan["elements"][view_elements[0]:view_elements[-1]]
    views = np.diff(sample_views)
    samples = np.repeat(np.repeat(np.arange(first, end, dtype=np.int64), views), np.diff(view_elements))
    counts = element_token_counts(dataset, group, geometry, records, samples)
    grids.see(dataset, records, samples, base)
    cumulative = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
    return views, np.diff(cumulative[view_elements - view_elements[0]])


def _picked(views: np.ndarray, tokens: np.ndarray, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(views, tokens) of the chunk's samples ``samples`` (in that order, repeats allowed) from those of all of it."""
    offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(views)])
    counts = views[samples]
    starts = np.cumsum(counts) - counts
    chosen = np.repeat(offsets[samples] - starts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    return counts, tokens[chosen]


def _image_kinds(group: GroupConfig, geometry: ModelGeometry) -> tuple[tuple[int, ImageTransform | None, int, str],
                                                                          ...]:
    """(kind, the group's transform, patch side in pixels, the geometry's grid limit) of VAE and ViT images."""
    return ((fmt.VAE_IMAGE, group.vae_transform, geometry.vae_image_downsample, "max_latent_size"),
            (fmt.VIT_IMAGE, group.vit_transform, geometry.vit_patch_size, "max_num_patch_per_side"))


def element_token_counts(dataset: MMIDXDataset, group: GroupConfig, geometry: ModelGeometry, records: np.ndarray,
                         samples: np.ndarray) -> np.ndarray:
    """The packed tokens of plan records ``records`` (of a multimodal dataset of one set of files) of samples
    ``samples`` (one each), as the pack builder writes them: a text's tokens, or an image's patches or latents
    after the group's transform of its stored size, plus the element's two framing tokens. The dataset's structure
    must be checked (:meth:`~mmidx.read.dataset.MMIDXDataset.check_structure`): its index arrays are read
    unchecked."""
    plan, tokens = dataset.plan, dataset.tokens
    counts = np.full(len(records), 2, dtype=np.int64)
    kind = records["kind"]
    payload = records["payload"].astype(np.int64)
    is_text = kind == fmt.TEXT
    counts[is_text] += tokens.sequence_lengths[tokens.document_indices[samples[is_text]] + payload[is_text]]
    images = plan["sample_image_offsets"][samples] + payload
    info = plan["image_info"]
    for code, transform, patch, _ in _image_kinds(group, geometry):
        selected = kind == code
        if not selected.any():
            continue
        if transform is None:
            raise ValueError(f"group {group.name!r}: {dataset.prefix} has {fmt.KIND_NAMES[code]} elements but "
                             "the group has no image_transform_args")
        number = images[selected]
        counts[selected] += num_image_tokens(info["width"][number], info["height"][number], transform,
                                             img_nums=records["img_num"][selected], patch_size=patch)
    return counts


class _Grids:
    """The check that no image element's patch grid is wider or taller than the model's position table (BAGEL's
    extrapolated ids would collide), made a chunk at a time: it keeps the widest grid seen of each image kind and
    refuses the dataset, naming the first such image of the widest grid and the value it needs, at the end."""

    def __init__(self, dataset: MMIDXDataset, group: GroupConfig, geometry: ModelGeometry):
        self.dataset, self.group = dataset, group
        self.kinds = [] if geometry.interpolate_pos else \
            [(code, transform, patch, name, getattr(geometry, name))
             for code, transform, patch, name in _image_kinds(group, geometry) if transform is not None]
        self.widest: dict[int, tuple[int, ...]] = {}  # kind -> (side, sample, image, width, height, grid h, grid w)

    def see(self, part: MMIDXDataset, records: np.ndarray, samples: np.ndarray, base: int) -> None:
        """Take in plan ``records`` of ``part`` (a dataset of one set of files) and their ``samples`` there, which
        are samples ``base + samples`` of the dataset checked."""
        kind = records["kind"]
        for code, transform, patch, _, limit in self.kinds:
            selected = np.flatnonzero(kind == code)
            if not len(selected):
                continue
            elements, numbers, plan = records[selected], samples[selected], part.plan
            info = plan["image_info"][plan["sample_image_offsets"][numbers] + elements["payload"]]
            widths, heights = transform.output_shapes(info["width"], info["height"], elements["img_num"])
            sides = np.maximum(heights // patch, widths // patch)
            worst = int(np.argmax(sides))
            if sides[worst] > max(limit, self.widest.get(code, (0,))[0]):
                self.widest[code] = (int(sides[worst]), base + int(numbers[worst]), int(elements["payload"][worst]),
                                     int(info["width"][worst]), int(info["height"][worst]), int(heights[worst]),
                                     int(widths[worst]))

    def check(self) -> None:
        """Refuse the widest grid past its limit (VAE images first), if any."""
        for code, _, patch, name, limit in self.kinds:
            if code not in self.widest:
                continue
            side, sample, image, width, height, grid_height, grid_width = self.widest[code]
            source, row = self.dataset[sample].origin
            where = f" ({source} row {row})" if source is not None else ""
            raise ValueError(
                f"group {self.group.name!r}, dataset {self.dataset.prefix}: image {image} of sample {sample}{where}, "
                f"{width}x{height} stored, becomes a {grid_height // patch}x{grid_width // patch} grid of "
                f"{patch}-pixel patches, more than {name}={limit}; set {name} to at least {side} or lower the "
                "group's max_image_size")


def view_table(config: DataConfig, datasets: list[list[MMIDXDataset]],
               selections: list[list[np.ndarray | None]] | None = None) -> ViewTable:
    """Every view's packed size, all groups' datasets end to end (in config order), counting only
    each dataset's used samples (``selections`` per group and dataset, rising sample numbers; None: all).

    The table is the one array of the pack index's build that grows with the datasets: int32 token counts, 4
    bytes a view, and view offsets (8 bytes a sample) only when some sample has more than one view."""
    if selections is None:
        selections = [[None] * len(group) for group in datasets]
    used = [[_used_counts(dataset, selection) for dataset, selection in zip(group, chosen, strict=True)]
            for group, chosen in zip(datasets, selections, strict=True)]
    samples = sum(count for group in used for count, _ in group)
    views = sum(count for group in used for _, count in group)
    tokens = np.empty(views, np.int32)
    offsets = None if views == samples else np.empty(samples + 1, np.int64)  # (every sample has a view)
    if offsets is not None:
        offsets[0] = 0
    group_base = np.concatenate([[0], np.cumsum([sum(count for count, _ in group) for group in used])])
    sample, view, max_views = 0, 0, 1
    for group, group_datasets, group_selections in zip(config.groups, datasets, selections, strict=True):
        for dataset, selection in zip(group_datasets, group_selections, strict=True):
            for chunk_views, chunk_tokens in dataset_views(dataset, group, config.geometry, selection):
                if len(chunk_tokens) and chunk_tokens.max() > _VIEW_TOKENS_MAX:
                    raise ValueError(f"{dataset.prefix}: a view of {int(chunk_tokens.max()):,} tokens, more than the "
                                     f"{_VIEW_TOKENS_MAX:,} a pack index sizes; leave such samples out")
                tokens[view:view + len(chunk_tokens)] = chunk_tokens
                if offsets is not None:
                    offsets[sample + 1:sample + 1 + len(chunk_views)] = view + np.cumsum(chunk_views)
                    max_views = max(max_views, int(chunk_views.max()))
                sample += len(chunk_views)
                view += len(chunk_tokens)
    return ViewTable(group_base.astype(np.int64), tokens, offsets, max_views)


def _used_counts(dataset: MMIDXDataset, selection: np.ndarray | None) -> tuple[int, int]:
    """(samples, views) of ``dataset``'s samples ``selection`` (None: all of them), from the offsets alone."""
    dataset.check_structure()
    parts = dataset.parts
    if selection is None:
        return len(dataset), sum(len(part.dataset) if (plan := part.dataset.plan) is None
                                 else int(plan["sample_view_offsets"][-1]) for part in parts)
    selection = _checked(dataset, selection)
    starts = part_starts(dataset)
    bounds = np.searchsorted(selection, starts)
    views = 0
    for number in np.flatnonzero(np.diff(bounds)).tolist():
        part = parts[number].dataset
        chosen = selection[bounds[number]:bounds[number + 1]] - starts[number]
        if part.plan is None or int(part.plan["sample_view_offsets"][-1]) == len(part):
            views += len(chosen)  # one view each (every sample has one)
            continue
        offsets = part.plan["sample_view_offsets"]
        for first in range(0, len(chosen), CHUNK_SAMPLES):
            picked = chosen[first:first + CHUNK_SAMPLES]
            views += int((offsets[picked + 1] - offsets[picked]).sum())
    return len(selection), views


def _checked(dataset: MMIDXDataset, selection: np.ndarray) -> np.ndarray:
    """``selection`` as int64, refused unless it is rising sample numbers of ``dataset``."""
    selection = np.asarray(selection, dtype=np.int64)
    if len(selection) and (selection[0] < 0 or selection[-1] >= len(dataset) or np.any(selection[1:] < selection[:-1])):
        raise ValueError(f"{dataset.prefix}: a selection of samples must be rising sample numbers of the dataset")
    return selection
