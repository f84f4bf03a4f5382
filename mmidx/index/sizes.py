"""A view's packed size from a dataset's index arrays alone, never decoding an image: each element's tokens as the
pack builder writes them (a text's tokens, an image's patches or latents after its group's transform of the stored
size, two framing tokens each), summed per view for the pack index (exact when CFG dropout drops nothing), or kept
per element for the packs' sizes after dropout (:mod:`mmidx.index.pack_costs`).
"""

from __future__ import annotations

import numpy as np

from mmidx import format as fmt
from mmidx.config import DataConfig, GroupConfig, ModelGeometry
from mmidx.images.transform import ImageTransform, num_image_tokens
from mmidx.index.stream import ViewTable
from mmidx.index.subsets import selected_views
from mmidx.read.dataset import MMIDXDataset


def view_token_counts(dataset: MMIDXDataset, group: GroupConfig,
                      geometry: ModelGeometry) -> tuple[np.ndarray, np.ndarray]:
    """(view_offsets, view_tokens): the views of sample s are ``view_tokens[view_offsets[s]:view_offsets[s+1]]``.

    Each view's size counts every element's tokens plus its two framing tokens, as BAGEL's packer
    estimates a sample (``num_tokens + 2 * len(sequence_plan)``); it is exact when nothing is dropped.
    """
    dataset.check_structure()  # everything below indexes with the index arrays
    tokens = dataset.tokens
    plan = dataset.plan
    if plan is None:  # text datasets: one view, one loss-bearing text element per sequence
        cumulative = np.concatenate([[0], np.cumsum(tokens.sequence_lengths.astype(np.int64) + 2)])
        return np.arange(len(dataset) + 1, dtype=np.int64), np.diff(cumulative[tokens.document_indices])
    elements = plan["elements"]
    sample_of_element = dataset.element_samples()
    counts = element_token_counts(dataset, group, geometry, elements, sample_of_element)
    if not geometry.interpolate_pos:
        for code, transform, patch, limit in _image_kinds(group, geometry):
            selected = np.flatnonzero(elements["kind"] == code)
            if len(selected):
                _check_grids(dataset, group, selected, transform, patch, limit, getattr(geometry, limit))
    cumulative = np.concatenate([[0], np.cumsum(counts)])
    return plan["sample_view_offsets"].astype(np.int64), np.diff(cumulative[plan["view_element_offsets"]])


def _image_kinds(group: GroupConfig, geometry: ModelGeometry) -> tuple[tuple[int, ImageTransform | None, int, str],
                                                                          ...]:
    """(kind, the group's transform, patch side in pixels, the geometry's grid limit) of VAE and ViT images."""
    return ((fmt.VAE_IMAGE, group.vae_transform, geometry.vae_image_downsample, "max_latent_size"),
            (fmt.VIT_IMAGE, group.vit_transform, geometry.vit_patch_size, "max_num_patch_per_side"))


def element_token_counts(dataset: MMIDXDataset, group: GroupConfig, geometry: ModelGeometry, records: np.ndarray,
                         samples: np.ndarray) -> np.ndarray:
    """The packed tokens of plan records ``records`` (of a multimodal dataset) of samples ``samples`` (one each),
    as the pack builder writes them: a text's tokens, or an image's patches or latents after the group's transform
    of its stored size, plus the element's two framing tokens. The dataset's structure must be checked
    (:meth:`~mmidx.read.dataset.MMIDXDataset.check_structure`): its index arrays are read unchecked."""
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


def _check_grids(dataset: MMIDXDataset, group: GroupConfig, selected: np.ndarray, transform: ImageTransform,
                 patch: int, limit_name: str, limit: int) -> None:
    """Refuse the index when an image element's patch grid is wider or taller than the model's position
    table (BAGEL's extrapolated ids would collide), naming the largest such image and the value it needs."""
    plan = dataset.plan
    elements = plan["elements"][selected]
    samples = dataset.element_samples()[selected]
    number = plan["sample_image_offsets"][samples] + elements["payload"]
    info = plan["image_info"][number]
    widths, heights = transform.output_shapes(info["width"], info["height"], elements["img_num"])
    sides = np.maximum(heights // patch, widths // patch)
    if len(sides) == 0 or sides.max() <= limit:
        return
    worst = int(np.argmax(sides))
    sample, image = int(samples[worst]), int(elements["payload"][worst])
    source, row = dataset[sample].origin
    where = f" ({source} row {row})" if source is not None else ""
    raise ValueError(
        f"group {group.name!r}, dataset {dataset.prefix}: image {image} of sample {sample}{where}, "
        f"{int(info['width'][worst])}x{int(info['height'][worst])} stored, becomes a "
        f"{int(heights[worst]) // patch}x{int(widths[worst]) // patch} grid of {patch}-pixel patches, more than "
        f"{limit_name}={limit}; set {limit_name} to at least {int(sides.max())} or lower the group's max_image_size")


def view_table(config: DataConfig, datasets: list[list[MMIDXDataset]],
               selections: list[list[np.ndarray | None]] | None = None) -> ViewTable:
    """Every view's packed size, all groups' datasets end to end (in config order), counting only
    each dataset's used samples (``selections`` per group and dataset; None: all)."""
    if selections is None:
        selections = [[None] * len(group) for group in datasets]
    view_offsets, view_tokens = [], []
    for group, group_datasets, group_selections in zip(config.groups, datasets, selections, strict=True):
        offsets_parts, token_parts, base = [np.zeros(1, np.int64)], [], 0
        for dataset, selection in zip(group_datasets, group_selections, strict=True):
            offsets, tokens = view_token_counts(dataset, group, config.geometry)
            if selection is not None:
                offsets, tokens = selected_views(offsets, tokens, selection)
            offsets_parts.append(offsets[1:] + base)
            token_parts.append(tokens)
            base += int(offsets[-1])
        view_offsets.append(np.concatenate(offsets_parts))
        view_tokens.append(np.concatenate(token_parts))
    return ViewTable.of(view_offsets, view_tokens)
