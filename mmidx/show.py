"""A picture of a pack: its token layout (elements coloured by kind, loss marked) above its attention.

The attention panel samples the mask predicate (:func:`mmidx.masks.mask_predicate`, the one rule
every mask is built from) at one query and one key per pixel, so a 36K-token pack costs about a
million predicate evaluations, never the L² mask. Allowed cells take the colour of the key's kind,
so a person sees what each part of the sequence attends to; blocked cells are white.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw

from mmidx.masks import mask_predicate
from mmidx.packing import PackedBatch

COLOURS = {
    "text": (66, 133, 244),
    "vit": (52, 168, 83),
    "vae_clean": (251, 188, 4),
    "vae_noised": (234, 67, 53),
    "padding": (200, 200, 200),
}
LOSS_COLOUR = (20, 20, 20)


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


def render(batch: PackedBatch, *, width: int = 1024, strip_height: int = 40) -> Image.Image:
    """The picture of ``batch`` (layout strip, loss bar, sample boundaries, attention panel, legend)."""
    split_lens, attn_modes, sample_lens = batch.flat_split_metadata(pad=True)
    length = max(sum(sample_lens), 1)
    kinds, loss = token_kinds(batch, length)
    positions = np.minimum((np.arange(width) + 0.5) * length / width, length - 1).astype(np.int64)
    palette = np.array(list(COLOURS.values()), dtype=np.uint8)
    legend_height, gap = 24, 6
    canvas = np.full((legend_height + strip_height + 6 + gap + width, width, 3), 255, dtype=np.uint8)
    top = legend_height
    canvas[top:top + strip_height] = palette[kinds[positions]][None]
    canvas[top + strip_height:top + strip_height + 6][:, loss[positions]] = LOSS_COLOUR
    predicate = mask_predicate(split_lens, attn_modes, sample_lens, device="cpu")
    q = torch.from_numpy(positions)
    allowed = predicate(None, None, q[:, None], q[None, :]).numpy()
    panel = np.where(allowed[..., None], palette[kinds[positions]][None, :, :], 255).astype(np.uint8)
    panel_top = top + strip_height + 6 + gap
    canvas[panel_top:] = panel
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    boundary = 0
    for sample_len in sample_lens[:-1]:
        boundary += sample_len
        x = int(boundary * width / length)
        draw.line([(x, top), (x, top + strip_height + 6)], fill=(0, 0, 0))
    x = 4
    for name, colour in [*COLOURS.items(), ("loss", LOSS_COLOUR)]:
        draw.rectangle([x, 6, x + 12, 18], fill=colour)
        draw.text((x + 16, 6), name, fill=(0, 0, 0))
        x += 26 + 7 * len(name)
    draw.text((x + 10, 6), f"{batch.sequence_length:,} tokens, {len(batch.sample_lens)} samples, "
                           f"{len(split_lens) - 1} splits", fill=(0, 0, 0))
    return image
