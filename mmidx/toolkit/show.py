"""A picture of a pack: what attends to what, in which sample.

The top panel is the whole pack: a layout strip (each token coloured by its kind, loss marked
below it) above the attention mask, query tokens down the rows and key tokens along the columns,
every sample labelled on both axes (``s3`` … in the table under the panel: dataset, sample number,
view, tokens, splits). When padding is more than half the pack, the panel shows the real tokens only.
The bottom panel zooms into one sample with a split-scaled axis: every split gets at least a few
pixels, so a 12-token text next to a 1,371-token image stays visible, and each split is labelled
with its attention mode, kind and length.

Both panels sample the mask predicate (:func:`mmidx.pack.masks.mask_predicate`, the one rule every
mask is built from) at one query and one key per pixel, so a 36K-token pack costs about a million
predicate evaluations, never the L² mask. Allowed cells take the colour of the key's kind; blocked
cells are white.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from mmidx.pack.batch import PackedBatch
from mmidx.pack.masks import mask_predicate

COLOURS = {
    "text": (66, 133, 244),
    "vit": (52, 168, 83),
    "vae_clean": (251, 188, 4),
    "vae_noised": (234, 67, 53),
    "padding": (200, 200, 200),
}
LOSS_COLOUR = (20, 20, 20)
BOUNDARY_COLOUR = (90, 90, 90)
PALETTE = np.array(list(COLOURS.values()), dtype=np.uint8)
LEFT, TOP_LABELS, STRIP, LOSS_BAR, LINE = 190, 150, 16, 5, 15  # pixel sizes of the layout


def token_kinds(batch: PackedBatch, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(kind code per token, loss flag per token) over ``length`` positions (0..4 as in COLOURS' order)."""
    names = list(COLOURS)
    kinds = np.full(length, names.index("padding"), dtype=np.int64)
    kinds[: batch.sequence_length] = names.index("text")
    tensors = batch.tensors
    if "packed_vit_token_indexes" in tensors:
        kinds[tensors["packed_vit_token_indexes"].numpy()] = names.index("vit")
    if "packed_vae_token_indexes" in tensors:
        vae = tensors["packed_vae_token_indexes"].numpy()
        noised = np.isfinite(tensors["packed_timesteps"].numpy())
        kinds[vae[noised]] = names.index("vae_noised")
        kinds[vae[~noised]] = names.index("vae_clean")
    loss = np.zeros(length, dtype=bool)
    for key in ("ce_loss_indexes", "mse_loss_indexes"):
        if key in tensors:
            loss[tensors[key].numpy().astype(np.int64)] = True
    return kinds, loss


def split_labels(batch: PackedBatch, sample: int, kinds: np.ndarray) -> list[str]:
    """Label of each split of the pack's ``sample``: attention mode, kind (of most of its tokens), tokens.

    A split of noised VAE tokens is labelled with the timestep they share instead of its kind
    (``noise vae t=+0.73 1,024``): the frames of one group of a video clip share one noise level
    and different groups draw their own, so groups side by side read apart.
    """
    names = list(COLOURS)
    first = sum(batch.sample_lens[:sample])
    starts = first + np.concatenate([[0], np.cumsum(batch.split_lens[sample])[:-1]]).astype(np.int64)
    vae = batch.tensors.get("packed_vae_token_indexes")
    vae = np.zeros(0, dtype=np.int64) if vae is None else vae.numpy()
    timesteps = batch.tensors["packed_timesteps"].numpy() if len(vae) else np.zeros(0)
    labels = []
    for mode, start, length in zip(batch.attn_modes[sample], starts, batch.split_lens[sample], strict=True):
        inside = timesteps[np.searchsorted(vae, start):np.searchsorted(vae, start + length)]
        noised = inside[np.isfinite(inside)]
        kind = f"vae t={noised[0]:+.2f}" if len(noised) else names[np.bincount(kinds[start:start + length]).argmax()]
        labels.append(f"{mode} {kind} {length:,}")
    return labels


def _font(size: int) -> Any:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def sample_labels(batch: PackedBatch) -> list[str]:
    """Short labels ``s<position> <dataset> #<sample> v<view>`` of the pack's samples."""
    return [f"s{position} {os.path.basename(str(entry['dataset']))} #{entry['sample']} v{entry['view']}"
            for position, entry in enumerate(batch.batch_data_indexes)]


def split_scaled_edges(lengths: list[int], pixels: int, min_pixels: int) -> np.ndarray:
    """Pixel edges of spans of ``lengths`` tokens on an axis of ``pixels``: proportional, but each at least
    ``min_pixels`` (less when there are too many spans to give every one that much)."""
    lengths_array = np.asarray(lengths, dtype=np.float64)
    floor = min(float(min_pixels), pixels / max(len(lengths), 1))
    widths = np.maximum(floor, lengths_array / lengths_array.sum() * pixels)
    small = widths <= floor
    if (~small).any():
        widths[~small] *= (pixels - floor * small.sum()) / widths[~small].sum()
    return np.round(np.concatenate([[0], np.cumsum(widths)])).astype(np.int64)


def pixel_positions(starts: list[int], lengths: list[int], edges: np.ndarray) -> np.ndarray:
    """The token each pixel shows: span i's pixels ``edges[i]:edges[i+1]`` spread over its tokens."""
    out = []
    for start, length, left, right in zip(starts, lengths, edges[:-1], edges[1:], strict=True):
        count = int(right - left)
        out.append(start + np.minimum(((np.arange(count) + 0.5) * length / max(count, 1)).astype(np.int64),
                                      length - 1))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def mask_pixels(predicate: Any, positions: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    """(P, P, 3) colours of the mask at ``positions`` (queries down, keys across): the key's kind where the
    predicate allows attention, white where it blocks it."""
    q = torch.from_numpy(positions)
    allowed = predicate(None, None, q[:, None], q[None, :]).numpy()
    return np.where(allowed[..., None], PALETTE[kinds[positions]][None, :, :], 255).astype(np.uint8)


def _vertical_text(image: Image.Image, text: str, x_centre: int, bottom: int, font: Any, room: int) -> None:
    """``text`` rotated to read bottom-up, its baseline centred on ``x_centre``, ending at ``bottom``."""
    text = _fit(text, font, room)
    if not text:
        return
    width = int(font.getlength(text)) + 2
    label = Image.new("RGBA", (width, LINE), (255, 255, 255, 0))
    ImageDraw.Draw(label).text((1, 0), text, fill=(0, 0, 0), font=font)
    rotated = label.rotate(90, expand=True)
    image.paste(rotated, (x_centre - rotated.width // 2, bottom - rotated.height), rotated)


def _fit(text: str, font: Any, room: float) -> str:
    """``text`` cut to ``room`` pixels, ending in "..." where it was cut (so a cut never reads as the whole; Pillow's
    bitmap font, without FreeType, has no "…")."""
    if font.getlength(text) <= room:
        return text
    while text and font.getlength(text + "...") > room:
        text = text[:-1]
    return text + "..." if text else ""


def split_runs(modes: list[str], lengths: list[int]) -> list[str]:
    """A sample's splits as ``mode:tokens``, a run of equal ones written once with its count (``full:731 x11``; the
    default font has no ×)."""
    words = []
    for (mode, length), run in itertools.groupby(zip(modes, lengths, strict=True)):
        count = len(list(run))
        words.append(f"{mode}:{length}" + (f" x{count}" if count > 1 else ""))
    return words


def _wrap(words: list[str], font: Any, room: float) -> list[str]:
    """``words`` joined by spaces into lines of at most ``room`` pixels (a word wider than a line is cut)."""
    lines = [""]
    for word in words:
        joined = f"{lines[-1]} {word}" if lines[-1] else word
        if lines[-1] and font.getlength(joined) > room:
            lines.append(word)
        else:
            lines[-1] = joined
    return [_fit(line, font, room) for line in lines]


def sample_table(batch: PackedBatch, font: Any, width: int) -> list[list[tuple[float, str]]]:
    """The table under the pack: its lines, each a list of (x, text) placed in columns (the font is proportional,
    so columns are pixel positions, not padded strings); a sample's splits wrap onto lines of their own column
    rather than running off the picture's right edge."""
    gap = font.getlength("  ")
    name_x = 6 + max(font.getlength("sample"), font.getlength("s000")) + gap
    name_room = min(230.0, width / 4)
    ends = list(itertools.accumulate([name_x + name_room + gap + font.getlength("sample"),
                                      gap + font.getlength("view"), gap + font.getlength("000,000")]))
    splits_x = ends[-1] + gap
    header = "sample", "view", "tokens"
    lines = [[(6.0, "sample"), (name_x, "group / dataset"),
              *((end - font.getlength(text), text) for end, text in zip(ends, header, strict=True)),
              (splits_x, _fit("splits (attention mode:tokens; xN: N in a row)", font, width - 6 - splits_x))]]
    for position, entry in enumerate(batch.batch_data_indexes):
        numbers = (f"{entry['sample']:,}", f"{entry['view']}", f"{batch.sample_lens[position]:,}")
        splits = _wrap(split_runs(batch.attn_modes[position], batch.split_lens[position]), font,
                       width - 6 - splits_x)
        name = _fit(f"{entry['dataset_name']} / {os.path.basename(str(entry['dataset']))}", font, name_room)
        lines.append([(6.0, f"s{position}"), (name_x, name),
                      *((end - font.getlength(text), text) for end, text in zip(ends, numbers, strict=True)),
                      (splits_x, splits[0])])
        lines += [[(splits_x, more)] for more in splits[1:]]
    return lines


def header(head: str, pad: int, real: int, crop: bool, font: Any, room: float) -> str:
    """The picture's first line: ``head`` and the padding, said in as much detail as fits in ``room`` pixels
    (on a narrow picture the padding note shortens rather than being cut off)."""
    if not pad:
        return _fit(head, font, room)
    notes = ([f", padding {pad:,} tokens (not shown: it would fill {pad / (real + pad):.0%} of the axes)",
              f", padding {pad:,} tokens not shown", f", {pad:,} padding hidden"] if crop else
             [f", padding {pad:,} tokens", f", {pad:,} padding"])
    for note in notes:
        if font.getlength(head + note) <= room:
            return head + note
    return _fit(head + notes[-1], font, room)


def _axes(image: Image.Image, top: int, size: int, edges: np.ndarray, labels: list[str], font: Any) -> None:
    """Span labels above the strip (keys) and left of the panel (queries), and the boundaries in the panel."""
    draw = ImageDraw.Draw(image)
    panel_top = top + TOP_LABELS + STRIP + LOSS_BAR + 2
    for left, right, label in zip(edges[:-1], edges[1:], labels, strict=True):
        width = int(right - left)
        if width >= LINE - 3:
            _vertical_text(image, label, LEFT + int(left + right) // 2, top + TOP_LABELS - 2, font, TOP_LABELS - 4)
        if width >= LINE - 4:
            text = _fit(label, font, LEFT - 12)
            draw.text((LEFT - 6 - font.getlength(text), panel_top + (left + right) / 2 - LINE / 2 + 1), text,
                      fill=(0, 0, 0), font=font)
    for edge in edges[1:-1]:
        draw.line([(LEFT + edge, top + TOP_LABELS), (LEFT + edge, panel_top + size)], fill=BOUNDARY_COLOUR)
        draw.line([(LEFT - 4, panel_top + edge), (LEFT + size, panel_top + edge)], fill=BOUNDARY_COLOUR)
    small = _font(11)
    draw.text((LEFT, top + 2), "key tokens (columns)", fill=(0, 0, 0), font=small)
    _vertical_text(image, "query tokens (rows)", 8, panel_top + min(size, 140), small, size)


def _panel(image: Image.Image, top: int, positions: np.ndarray, kinds: np.ndarray, loss: np.ndarray,
           predicate: Any) -> None:
    """Layout strip, loss bar and attention mask of ``positions``, at ``top`` below the label area."""
    canvas = np.asarray(image).copy()
    strip_top = top + TOP_LABELS
    size = len(positions)
    canvas[strip_top:strip_top + STRIP, LEFT:LEFT + size] = PALETTE[kinds[positions]][None]
    canvas[strip_top + STRIP:strip_top + STRIP + LOSS_BAR, LEFT:LEFT + size][:, loss[positions]] = LOSS_COLOUR
    panel_top = strip_top + STRIP + LOSS_BAR + 2
    canvas[panel_top:panel_top + size, LEFT:LEFT + size] = mask_pixels(predicate, positions, kinds)
    image.paste(Image.fromarray(canvas))


def _legend(draw: ImageDraw.ImageDraw, y: int, font: Any) -> None:
    x = 6
    for name, colour in [*COLOURS.items(), ("loss", LOSS_COLOUR), ("white: blocked", (255, 255, 255))]:
        draw.rectangle([x, y + 2, x + 11, y + 13], fill=colour, outline=(120, 120, 120))
        draw.text((x + 15, y), name, fill=(0, 0, 0), font=font)
        x += 30 + int(font.getlength(name))


def render(batch: PackedBatch, *, width: int = 1024, zoom_sample: int | None = None,
           title: str = "") -> Image.Image:
    """The picture of ``batch``: the whole pack, the table of its samples, and one sample zoomed (by default
    the one with the most splits; ``zoom_sample`` picks another by its position in the pack)."""
    if width < LEFT + 200:
        raise ValueError(f"the picture needs a width of at least {LEFT + 200} pixels, not {width}")
    split_lens, attn_modes, sample_lens = batch.flat_split_metadata(pad=True)
    real, pad = batch.sequence_length, sample_lens[-1]
    samples = len(batch.sample_lens)
    if zoom_sample is None:
        zoom_sample = int(np.argmax([len(s) for s in batch.split_lens])) if samples else 0
    if not 0 <= zoom_sample < max(samples, 1):
        raise ValueError(f"sample {zoom_sample} is not in the pack: it holds {samples} samples")
    crop = pad > real  # padding dominates: show the real tokens only
    shown = sample_lens[:-1] if crop or pad == 0 else sample_lens
    size = width - LEFT - 10
    kinds, loss = token_kinds(batch, sum(sample_lens))
    predicate = mask_predicate(split_lens, attn_modes, sample_lens, device="cpu")
    labels = sample_labels(batch) + ([] if len(shown) == samples else ["padding"])
    font, bold = _font(12), _font(14)
    zoom_splits = batch.split_lens[zoom_sample] if samples else []
    table = sample_table(batch, font, width)
    table_height = LINE * len(table) + 8
    main_top, zoom_gap = 2 * LINE + 10, 3 * LINE
    zoom_top = main_top + TOP_LABELS + STRIP + LOSS_BAR + 2 + size + 8 + table_height + zoom_gap
    height = zoom_top + (TOP_LABELS + STRIP + LOSS_BAR + 2 + size + 8 if samples else 0)
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    draw.text((6, 2), header(f"{title}{real:,} tokens in {samples} sample{'s' if samples != 1 else ''}, "
                             f"{len(split_lens) - 1} splits", pad, real, crop, bold, width - 12),
              fill=(0, 0, 0), font=bold)
    _legend(draw, LINE + 5, font)
    starts = np.concatenate([[0], np.cumsum(shown)]).astype(np.int64)
    edges = np.round(starts / max(starts[-1], 1) * size).astype(np.int64)
    _panel(image, main_top, pixel_positions(list(starts[:-1]), list(shown), edges), kinds, loss, predicate)
    _axes(image, main_top, size, edges, labels, font)
    draw = ImageDraw.Draw(image)
    y = main_top + TOP_LABELS + STRIP + LOSS_BAR + 2 + size + 8
    for line in table:
        for x, text in line:
            draw.text((x, y), text, fill=(0, 0, 0), font=font)
        y += LINE
    if not samples:
        return image
    entry = batch.batch_data_indexes[zoom_sample]
    draw.text((6, zoom_top - 2 * LINE),
              _fit(f"s{zoom_sample} zoomed: {entry['dataset_name']} sample {entry['sample']} view {entry['view']}, "
                   f"{batch.sample_lens[zoom_sample]:,} tokens; split-scaled axes (each split at least 24 px)",
                   bold, width - 12), fill=(0, 0, 0), font=bold)
    first = sum(batch.sample_lens[:zoom_sample])
    split_starts = list(first + np.concatenate([[0], np.cumsum(zoom_splits)[:-1]]).astype(np.int64))
    zoom_edges = split_scaled_edges(zoom_splits, size, 24)
    _panel(image, zoom_top, pixel_positions(split_starts, zoom_splits, zoom_edges), kinds, loss, predicate)
    _axes(image, zoom_top, size, zoom_edges, split_labels(batch, zoom_sample, kinds), font)
    return image
