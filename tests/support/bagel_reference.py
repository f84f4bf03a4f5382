"""A deliberately naive reference of BAGEL's per-sample packing and mask rules, for tests only.

Written with Python lists element by element from ``BAGEL_SEMANTICS.md`` (the project's written statement of
BAGEL's behaviour, kept with its design notes outside this repository), the same spec mmidx's packing was
written from, so it is not independent of mmidx: a misreading of the spec shared by
both passes. It has its own image conversion, resize rule, normalisation (a transcription of torchvision's
steps), patchify, position ids and masks, but it takes mmidx's stored samples, sequence plans (the views
mmidx drew) and random draws (``sample_randomness``) as input. What it proves: mmidx's optimised packing
(kernels, buffers, fast paths) computes what the naive reading of the spec computes. What it does not prove:
that either equals BAGEL. ``tools/check_bagel.py`` checks that against BAGEL's own code.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
from PIL import Image


def to_rgb(image):
    if image.mode == "RGBA" or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.split()[3])
        return white
    return image.convert("RGB")


def resized_size(width, height, max_size, min_size, stride, max_pixels, img_num):
    def divisible(value):
        return max(stride, int(round(value / stride) * stride))

    def scaled(w, h, scale):
        return divisible(round(w * scale)), divisible(round(h * scale))

    scale = max(min(max_size / max(width, height), 1.0), min_size / min(width, height))
    width, height = scaled(width, height, scale)
    if width * height > max_pixels / img_num:
        width, height = scaled(width, height, max_pixels / img_num / (width * height))
    if max(width, height) > max_size:
        width, height = scaled(width, height, max_size / max(width, height))
    return width, height


def transform(data, args, img_num):
    image = to_rgb(Image.open(io.BytesIO(bytes(data))))
    size = resized_size(image.width, image.height, args["max_image_size"], args["min_image_size"],
                        args["image_stride"], args.get("max_pixels", 14 * 14 * 9 * 1024), img_num)
    if size != image.size:
        image = image.resize(size, Image.BICUBIC)
    pixels = torch.tensor(np.array(image), dtype=torch.uint8)
    tensor = pixels.permute(2, 0, 1).float().div(255)
    return (tensor - 0.5) / 0.5


def patchify(image, p):
    c, h, w = image.shape
    return torch.einsum("chpwq->hwpqc", image.reshape(c, h // p, p, w // p, p)).reshape(-1, p * p * c)


def position_ids(height, width, patch, max_per_side):
    return [row * max_per_side + col for row in range(height // patch) for col in range(width // patch)]


def pack(samples, special, dropout, geometry, max_num_tokens, use_flex):
    """BAGEL's pack_sequence over ``samples`` (dicts: plan, texts, images, draws, transforms) + to_tensor."""
    s = {key: [] for key in ("sample_lens", "packed_position_ids", "split_lens", "attn_modes", "nested",
                             "packed_text_ids", "packed_text_indexes", "packed_label_ids", "ce_loss_indexes",
                             "ce_loss_weights", "vae_images", "packed_latent_position_ids", "vae_shapes",
                             "packed_vae_token_indexes", "packed_timesteps", "mse_loss_indexes",
                             "packed_vit_tokens", "vit_token_seqlens", "packed_vit_position_ids",
                             "packed_vit_token_indexes")}
    curr = 0
    for sample in samples:
        split_lens, attn_modes = [], []
        rope, sample_len, split_len, timestep = 0, 0, 0, None
        for e, item in enumerate(sample["plan"]):
            uniform, normal = sample["uniforms"][e], sample["normals"][e]
            if item["split_start"]:
                split_len = 0
            if item["type"] == "text":
                ids = [int(t) for t in sample["texts"][item["payload"]]]
                if item["enable_cfg"] and uniform < dropout["text"]:
                    continue
                shifted = [special["bos_token_id"], *ids]
                s["packed_text_ids"] += shifted
                s["packed_text_indexes"] += list(range(curr, curr + len(shifted)))
                if item["loss"]:
                    s["ce_loss_indexes"] += list(range(curr, curr + len(shifted)))
                    s["ce_loss_weights"] += [1 / math.sqrt(len(shifted))] * len(shifted)
                    s["packed_label_ids"] += [*ids, special["eos_token_id"]]
                curr += len(shifted)
                split_len += len(shifted)
                s["packed_text_ids"].append(special["eos_token_id"])
                s["packed_text_indexes"].append(curr)
                if item["special_token_loss"]:
                    s["ce_loss_indexes"].append(curr)
                    s["ce_loss_weights"].append(1.0)
                    s["packed_label_ids"].append(item["special_token_label"])
                curr += 1
                split_len += 1
                attn_modes.append("causal")
                s["packed_position_ids"] += list(range(rope, rope + split_len))
                rope += split_len
            else:
                vit = item["type"] == "vit_image"
                args = sample["vit_args"] if vit else sample["vae_args"]
                if item["enable_cfg"] and uniform < (dropout["vit"] if vit else dropout["vae"]):
                    rope += 1
                    continue
                image = transform(sample["images"][item["payload"]], args, item["img_num"])
                s["packed_text_ids"].append(special["start_of_image"])
                s["packed_text_indexes"].append(curr)
                curr += 1
                split_len += 1
                if vit:
                    tokens = patchify(image, geometry["vit_patch_size"])
                    s["packed_vit_token_indexes"] += list(range(curr, curr + len(tokens)))
                    s["packed_vit_tokens"].append(tokens)
                    s["vit_token_seqlens"].append(len(tokens))
                    s["packed_vit_position_ids"] += position_ids(image.shape[1], image.shape[2],
                                                                 geometry["vit_patch_size"],
                                                                 geometry["max_num_patch_per_side"])
                    count = len(tokens)
                else:
                    down = geometry["vae_image_downsample"]
                    h, w = image.shape[1] // down, image.shape[2] // down
                    count = h * w
                    s["vae_images"].append(image)
                    s["vae_shapes"].append((h, w))
                    s["packed_latent_position_ids"] += position_ids(image.shape[1], image.shape[2], down,
                                                                    geometry["max_latent_size"])
                    s["packed_vae_token_indexes"] += list(range(curr, curr + count))
                    if item["loss"]:
                        s["mse_loss_indexes"] += list(range(curr, curr + count))
                        if item["split_start"] or timestep is None:
                            timestep = normal
                        value = timestep
                    else:
                        value = float("-inf")
                    s["packed_timesteps"] += [value] * count
                curr += count
                split_len += count
                s["packed_text_ids"].append(special["end_of_image"])
                s["packed_text_indexes"].append(curr)
                if item["special_token_loss"]:
                    s["ce_loss_indexes"].append(curr)
                    s["ce_loss_weights"].append(1.0)
                    s["packed_label_ids"].append(item["special_token_label"])
                curr += 1
                split_len += 1
                if vit:
                    attn_modes.append("full")
                    s["packed_position_ids"] += [rope] * split_len
                    rope += 1
                else:
                    if item["split_start"]:
                        attn_modes.append("noise" if item["loss"] and "frame_delta" not in item else "full")
                    s["packed_position_ids"] += [rope] * (count + 2)
                    if "frame_delta" in item:
                        rope += item["frame_delta"]
                    elif not item["loss"]:
                        rope += 1
            if item["split_end"]:
                split_lens.append(split_len)
                sample_len += split_len
        s["sample_lens"].append(sample_len)
        s["split_lens"] += split_lens
        s["attn_modes"] += attn_modes
        s["nested"].append(dense_mask(split_lens, attn_modes))
    return to_tensor(s, use_flex, max_num_tokens)


def dense_mask(split_lens, attn_modes):
    """The three-step rule on a boolean matrix, then 0 / -inf."""
    n = sum(split_lens)
    allowed = [[False] * n for _ in range(n)]
    start = 0
    for length, mode in zip(split_lens, attn_modes, strict=True):
        for q in range(start, start + length):
            for k in range(0, start + length):
                allowed[q][k] = k < start or mode != "causal" or k <= q
        start += length
    start = 0
    for length, mode in zip(split_lens, attn_modes, strict=True):
        if mode == "noise":
            for q in range(n):
                for k in range(start, start + length):
                    allowed[q][k] = start <= q < start + length
        start += length
    mask = torch.tensor(allowed, dtype=torch.bool).reshape(n, n)
    return torch.zeros(n, n).masked_fill(~mask, float("-inf"))


def to_tensor(s, use_flex, max_num_tokens):
    data = {"sequence_length": sum(s["sample_lens"]), "sample_lens": list(s["sample_lens"]),
            "packed_text_ids": torch.tensor(s["packed_text_ids"]),
            "packed_text_indexes": torch.tensor(s["packed_text_indexes"]),
            "packed_position_ids": torch.tensor(s["packed_position_ids"])}
    if use_flex:
        pad = max_num_tokens - data["sequence_length"]
        data["split_lens"] = s["split_lens"] + [pad]
        data["attn_modes"] = s["attn_modes"] + ["causal"]
        data["sample_lens"] = data["sample_lens"] + [pad]
    else:
        data["nested_attention_masks"] = s["nested"]
    if s["vae_images"]:
        height = max(image.shape[1] for image in s["vae_images"])
        width = max(image.shape[2] for image in s["vae_images"])
        padded = torch.zeros(len(s["vae_images"]), 3, height, width)
        for i, image in enumerate(s["vae_images"]):
            padded[i, :, : image.shape[1], : image.shape[2]] = image
        data.update(padded_images=padded, patchified_vae_latent_shapes=s["vae_shapes"],
                    packed_latent_position_ids=torch.tensor(s["packed_latent_position_ids"]),
                    packed_vae_token_indexes=torch.tensor(s["packed_vae_token_indexes"]))
    if s["packed_vit_tokens"]:
        data.update(packed_vit_tokens=torch.cat(s["packed_vit_tokens"]),
                    packed_vit_position_ids=torch.tensor(s["packed_vit_position_ids"]),
                    packed_vit_token_indexes=torch.tensor(s["packed_vit_token_indexes"]),
                    vit_token_seqlens=torch.tensor(s["vit_token_seqlens"]))
    if s["packed_timesteps"]:
        data.update(packed_timesteps=torch.tensor(s["packed_timesteps"]),
                    mse_loss_indexes=torch.tensor(s["mse_loss_indexes"], dtype=torch.int64))
    if s["packed_label_ids"]:
        data.update(packed_label_ids=torch.tensor(s["packed_label_ids"]),
                    ce_loss_indexes=torch.tensor(s["ce_loss_indexes"]),
                    ce_loss_weights=torch.tensor(s["ce_loss_weights"]))
    return data
