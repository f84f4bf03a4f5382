"""Precached encodings in packed batches: which streams a group uses, their checks, and the batch keys.

``padded_latent`` is BAGEL's ``vae_model.encode(padded_images)`` in its padded layout: (n, C, max h,
max w) float32, each latent top-left, zeros elsewhere, in the order of ``patchified_vae_latent_shapes``.
Moments are sampled per pack: the noise of VAE slot s of pack k is ``torch.randn`` from a torch
generator seeded with the first 64-bit output of Philox keyed by (seed, counter (0, 1, s, k)) (torch's
CPU generator keeps its low 32 bits, so two slots share a noise stream with probability 2^-32 per
pair): a pure function of (config, seed, pack) like every other draw of a pack, and 2-4x cheaper than
Philox's own normals.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from mmidx import format as fmt
from mmidx.config import DataConfig, GroupConfig
from mmidx.format import FormatError
from mmidx.read.encoding_streams import IMG_NUM_RULE, EncodingStream, open_stream

USES = {"vae": ("image", "vae"), "vit": ("image", "vit"), "text": ("text", None)}  # what each use's stream holds


def group_encodings(config: DataConfig, override: Mapping[str, str] | None) -> list[dict[str, str]]:
    """Per group, the stream name of each use ("vae", "vit", "text"): ``override`` for all, else the group's own."""
    chosen = []
    for group in config.groups:
        names = dict(override if override is not None else group.encodings or {})
        unknown = sorted(set(names) - set(USES))
        if unknown:
            raise ValueError(f"group {group.name!r}: encodings {unknown} are unknown; the uses are {sorted(USES)}")
        chosen.append(names)
    return chosen


def mismatch(meta: dict[str, Any], group: GroupConfig, use: str) -> str | None:
    """What differs between a stream's recorded inputs and what ``group`` feeds ``use``, or None."""
    modality, transform = USES[use]
    if meta["modality"] != modality or meta.get("transform") != transform:
        return f"it holds {meta['modality']} encodings of the {meta.get('transform')} transform, {use} needs " \
               f"{modality} encodings{f' of the {transform} transform' if transform else ''}"
    if transform is None:
        return None
    used = group.vae_transform if transform == "vae" else group.vit_transform
    args = json.loads(json.dumps(dataclasses.asdict(used))) if used else None
    recorded = meta.get("transform_args")
    if args != recorded:
        keys = sorted(set(args or {}) | set(recorded or {}))
        differ = [f"{key} {(recorded or {}).get(key)!r} vs the config's {(args or {}).get(key)!r}"
                  for key in keys if (recorded or {}).get(key) != (args or {}).get(key)] or ["transform"]
        return "its image transform differs: " + "; ".join(differ)
    if meta.get("img_num_rule") != IMG_NUM_RULE:
        return f"its img_num rule {meta.get('img_num_rule')!r} is not this mmidx's {IMG_NUM_RULE!r}"
    return None


def checked_streams(config: DataConfig, datasets: list[list[Any]], names: list[dict[str, str]]) -> None:
    """Open every stream the config uses and refuse, naming the difference, any computed from other inputs."""
    for group, group_datasets, uses in zip(config.groups, datasets, names, strict=True):
        for use, name in uses.items():
            for dataset in group_datasets:
                stream = open_stream(dataset, name)  # refuses another version of the dataset
                problem = mismatch(stream.meta, group, use)
                if problem:
                    raise ValueError(f"{fmt.encoding_path(dataset.prefix, name, 'json')} cannot serve as {use} "
                                     f"encodings of group {group.name!r}: {problem}; precache it again")


def latent(stream: EncodingStream, item: int, img_num: int, height: int, width: int, down: int) -> torch.Tensor:
    """The stored (C, h, w) or moments (2, C, h, w) of an image the pack resizes to (height, width)."""
    value = stream.tensor(item, img_num)
    h, w = value.shape[-2:] if value.dim() >= 3 else (0, 0)
    moments = stream.meta["store"] == "moments"
    if value.dim() != 3 + moments or (moments and value.shape[0] != 2) or not h or not w or height % h or \
            width % w or height // h != width // w or down % (height // h):
        raise FormatError(f"{fmt.encoding_path(stream.prefix, stream.name, 'idx')}: image {item}'s record has shape "
                          f"{tuple(value.shape)}, which is no latent of a {height}x{width} image under a "
                          f"{down}-pixel latent patch: corrupted or from another transform")
    return value


def noise_generator(seed: int, pack_index: int, slot: int) -> torch.Generator:
    """The generator of the noise of VAE slot ``slot`` of pack ``pack_index`` (the rule of the module's docstring)."""
    key = np.random.Philox(key=seed, counter=[0, 1, slot, pack_index]).random_raw()
    return torch.Generator().manual_seed(int(key))


def padded_latent(latents: list[torch.Tensor], seed: int, pack_index: int,
                  allocate: Callable[..., torch.Tensor] = torch.empty) -> torch.Tensor:
    """(n, C, max h, max w) float32 from ``allocate``, each latent top-left, zeros elsewhere; moments sampled
    per pack slot, written in place (mean + exp(logvar / 2) * noise, with no float copy of the moments)."""
    channels = latents[0].shape[-3]
    if any(value.shape[-3] != channels for value in latents):
        raise FormatError("the precached latents of one pack have different channel counts: the streams come from "
                          "different encoders; use one encoding name for every group")
    height, width = max(value.shape[-2] for value in latents), max(value.shape[-1] for value in latents)
    padded = allocate(len(latents), channels, height, width)
    noise = torch.empty(channels * height * width)
    for slot, value in enumerate(latents):
        h, w = value.shape[-2:]
        padded[slot, :, h:].zero_()
        padded[slot, :, :h, w:].zero_()
        target = padded[slot, :, :h, :w]
        if value.dim() == 4:
            draw = torch.randn((channels, h, w), generator=noise_generator(seed, pack_index, slot),
                               out=noise[: channels * h * w].view(channels, h, w))
            torch.mul(value[1], 0.5, out=target)
            target.exp_().mul_(draw).add_(value[0])
        else:
            target.copy_(value)
    return padded


def vit_embedding(stream: EncodingStream, item: int, img_num: int, height: int, width: int) -> torch.Tensor:
    """The stored (height, width, D) encoder output (token-major) of an image the pack cuts into height x width
    ViT patches."""
    value = stream.tensor(item, img_num)
    if value.dim() != 3 or tuple(value.shape[:2]) != (height, width):
        raise FormatError(f"{fmt.encoding_path(stream.prefix, stream.name, 'idx')}: image {item}'s record has shape "
                          f"{tuple(value.shape)}, not ({height}, {width}, D) for its {height}x{width} ViT patches: "
                          "corrupted or from another encoder (patch size) or transform")
    return value


def packed_vit_embeddings(values: list[torch.Tensor], allocate: Callable[..., torch.Tensor] = torch.empty) \
        -> torch.Tensor:
    """(tokens, D) float32: each image's (h, w, D) record, in the order of ``packed_vit_tokens``."""
    dims = values[0].shape[2]
    if any(value.shape[2] != dims for value in values):
        raise FormatError("the precached ViT encodings of one pack have different widths: the streams come from "
                          "different encoders; use one encoding name for every group")
    counts = [value.shape[0] * value.shape[1] for value in values]
    packed = allocate(sum(counts), dims)
    start = 0
    for value, count in zip(values, counts, strict=True):
        packed[start:start + count].copy_(value.view(count, dims))
        start += count
    return packed


def text_embedding(stream: EncodingStream, sequence: int, length: int) -> torch.Tensor:
    """The stored (L, D) embedding of a text sequence of ``length`` tokens."""
    value = stream.tensor(sequence, 0)
    if value.dim() != 2 or value.shape[0] != length:
        raise FormatError(f"{fmt.encoding_path(stream.prefix, stream.name, 'idx')}: sequence {sequence}'s record has "
                          f"shape {tuple(value.shape)}, not ({length}, D): corrupted or from another dataset")
    return value
