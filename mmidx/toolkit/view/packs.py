"""A pack as the browser draws it: its samples, and its attention layout as a scalable SVG.

The pack is built as the loader builds it (same samples, views and CFG dropout), with its images
left encoded, so drawing it decodes nothing. The picture is ``mmidx show``'s: a layout strip (each
token coloured by its kind, loss marked under it) above the attention mask, queries down and keys
across, sampled from the one mask rule (:func:`mmidx.pack.masks.mask_predicate`) at one query and one
key per pixel on split-scaled axes (every split at least a few pixels wide). The mask is an
embedded PNG; the strip, the boundaries and the hover targets are SVG, so hovering a split names
its sample and split, and clicking a sample's rows opens that sample.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mmidx.pack.masks import mask_predicate
from mmidx.toolkit.show import (
    COLOURS,
    LOSS_COLOUR,
    PALETTE,
    mask_pixels,
    pixel_positions,
    split_scaled_edges,
    token_kinds,
)

AXIS = 640  # pixels of each axis of the mask
LABELS = 170  # pixels left of the mask for sample labels
STRIP, LOSS_BAR, GAP = 14, 5, 4
MIN_SPLIT_PIXELS = 3
MAX_HOVER_SPLITS = 2000  # beyond this many splits, hover names samples only (the SVG stays small)


@dataclass(frozen=True)
class Split:
    """One split of a packed sample: its attention mode, the kind of its middle token, its tokens."""

    mode: str
    kind: str
    tokens: int


@dataclass(frozen=True)
class PackedSample:
    """One sample of a pack: where it comes from and how it is split."""

    position: int
    group: str
    dataset: str  # the catalog's name of its dataset
    sample: int
    view: int
    tokens: int
    splits: list[Split]


@dataclass(frozen=True)
class PackLayout:
    """What the pack page shows: the samples in order, the pack's tokens and budget, and the SVG."""

    pack: int
    samples: list[PackedSample]
    tokens: int
    max_num_tokens: int
    svg: str


def _runs(values: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, value) of each run of equal values."""
    if len(values) == 0:
        return []
    cuts = np.flatnonzero(np.diff(values)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(values)]])
    return list(zip(starts.tolist(), ends.tolist(), values[starts].tolist(), strict=True))


def _hex(colour: tuple[int, ...] | np.ndarray) -> str:
    return "#" + "".join(f"{int(c):02x}" for c in colour[:3])


def _png(pixels: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode("ascii")


def pack_layout(packs: Any, pack: int, names: dict[tuple[int, int], str], sample_url: Any) -> PackLayout:
    """The layout of pack ``pack`` of ``packs`` (the catalog's index and builder); ``names`` maps (group,
    dataset) to the catalog's dataset names, ``sample_url(name, sample)`` gives a sample page's URL."""
    items = packs.index.items(pack)
    batch = packs.builder.build(pack, items)
    config = packs.index.config
    split_lens, attn_modes, sample_lens = batch.flat_split_metadata(pad=False)
    kinds, loss = token_kinds(batch, sum(sample_lens))
    kind_names = list(COLOURS)
    samples, first = [], 0
    for position, (item, lengths, modes) in enumerate(zip(items, batch.split_lens, batch.attn_modes, strict=True)):
        starts = first + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        splits = [Split(mode, kind_names[kinds[start + length // 2]], length)
                  for mode, start, length in zip(modes, starts.tolist(), lengths, strict=True)]
        samples.append(PackedSample(position, config.groups[item.group].name, names[(item.group, item.dataset)],
                                    item.sample, item.view, batch.sample_lens[position], splits))
        first += batch.sample_lens[position]
    svg = _svg(samples, split_lens, attn_modes, sample_lens, kinds, loss, sample_url)
    return PackLayout(pack, samples, batch.sequence_length, config.packing.max_num_tokens, svg)


def _svg(samples: list[PackedSample], split_lens: list[int], attn_modes: list[str], sample_lens: list[int],
         kinds: np.ndarray, loss: np.ndarray, sample_url: Any) -> str:
    split_starts = np.concatenate([[0], np.cumsum(split_lens)[:-1]]).astype(np.int64).tolist()
    edges = split_scaled_edges(split_lens, AXIS, MIN_SPLIT_PIXELS) if split_lens else np.zeros(1, np.int64)
    positions = pixel_positions(split_starts, split_lens, edges)
    top = STRIP + LOSS_BAR + GAP
    width, height = LABELS + AXIS + 2, top + AXIS + 2
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="attention" viewBox="0 0 {width} {height}" '
             f'role="img" aria-label="attention layout of the pack">']
    if len(positions):
        predicate = mask_predicate(split_lens, attn_modes, sample_lens, device="cpu")
        mask = mask_pixels(predicate, positions, kinds)
        parts.append(f'<image x="{LABELS}" y="{top}" width="{AXIS}" height="{AXIS}" '
                     f'href="data:image/png;base64,{_png(mask)}"/>')
        for start, end, kind in _runs(kinds[positions]):
            parts.append(f'<rect x="{LABELS + start}" y="0" width="{end - start}" height="{STRIP}" '
                         f'fill="{_hex(PALETTE[kind])}"/>')
        for start, end, flagged in _runs(loss[positions].astype(np.int64)):
            if flagged:
                parts.append(f'<rect x="{LABELS + start}" y="{STRIP}" width="{end - start}" height="{LOSS_BAR}" '
                             f'fill="{_hex(LOSS_COLOUR)}"/>')
    hover_splits = len(split_lens) <= MAX_HOVER_SPLITS
    number = 0  # the split's number in the pack
    for sample in samples:
        label = f"s{sample.position} {sample.dataset} #{sample.sample} v{sample.view}"
        left, right = int(edges[number]), int(edges[number + len(sample.splits)])
        parts.append(f'<a href="{html.escape(sample_url(sample.dataset, sample.sample))}">')
        bands = [(j, split) for j, split in enumerate(sample.splits)] if hover_splits else [(None, None)]
        for j, split in bands:
            if split is None:  # too many splits to name each: the sample's rows as one target
                low, high = left, right
                title = f"{label} ({sample.group}): {sample.tokens:,} tokens in {len(sample.splits)} splits"
            else:
                low, high = int(edges[number + j]), int(edges[number + j + 1])
                title = (f"{label} ({sample.group}), split {j} of {len(sample.splits)}: {split.mode} attention, "
                         f"{split.kind}, {split.tokens:,} tokens")
                parts.append(f'<rect class="split" x="{LABELS + low}" y="0" width="{high - low}" '
                             f'height="{STRIP + LOSS_BAR}"><title>{html.escape(title)}</title></rect>')
            parts.append(f'<rect class="band" x="0" y="{top + low}" width="{LABELS + AXIS}" height="{high - low}">'
                         f'<title>{html.escape(title + "; queries of this row, click to open the sample")}</title>'
                         '</rect>')
        if right - left >= 10:
            parts.append(f'<text x="{LABELS - 6}" y="{top + (left + right) / 2 + 4:.1f}" text-anchor="end">'
                         f'{html.escape(label[:26])}</text>')
        parts.append("</a>")
        if number:
            parts.append(f'<line x1="{LABELS}" y1="{top + left}" x2="{LABELS + AXIS}" y2="{top + left}"/>'
                         f'<line x1="{LABELS + left}" y1="0" x2="{LABELS + left}" y2="{top + AXIS}"/>')
        number += len(sample.splits)
    parts.append("</svg>")
    return "".join(parts)
