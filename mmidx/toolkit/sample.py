"""``mmidx sample``: one sample as a person reads it.

Every element of a view in order (kind, loss, cfg, split flags, frame delta, packed token count),
its texts decoded with the tokenizer the dataset was built with, its images (written to a folder
when asked, with their size and format), where it came from (source file and row) and its extra
JSON. Token counts are what the pack index counts for the element: its tokens plus the two framing
tokens, images at the size BAGEL's transform for the dataset's source type gives them.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from mmidx import format as fmt
from mmidx.read.dataset import MMIDXDataset

LOSS_MARK, MASKED_MARK = "┃", "┆"  # before each line of a text with loss, and of one without
EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tif",
              "MPO": "jpg", "JPEG2000": "jp2"}


def dataset_tokenizer(dataset: MMIDXDataset) -> tuple[Any, str | None]:
    """(tokenizer or None, why not): the tokenizer recorded in the metadata, if it loads and is the same one."""
    from mmidx.tokenizer import TokenizerError, recorded_tokenizer

    try:
        return recorded_tokenizer(dataset.tokenizer, str(dataset.prefix)), None
    except TokenizerError as error:
        return None, str(error).split(": ", 1)[1]


def describe_sample(prefix: str | os.PathLike | MMIDXDataset, index: int, *, view: int = 0,
                    output_dir: str | os.PathLike | None = None,
                    tokenizer: tuple[Any, str | None] | None = None,
                    max_text_tokens: int | None = None) -> dict[str, Any]:
    """Plain data describing sample ``index`` (view ``view``); its images are written under ``output_dir`` if given.

    ``prefix`` may be an opened dataset, and ``tokenizer`` the (tokenizer, why not) of :func:`dataset_tokenizer`
    already loaded (the viewer keeps both open); by default both are loaded here. ``max_text_tokens``: each
    text's ``token_ids`` and ``decoded`` cover its first that many tokens only (``shown_tokens`` says how many;
    ``tokens`` still counts them all), so a page showing the head of a huge text does not decode all of it."""
    from mmidx.config import config_for  # imported here: torch, which the module's other users (export) do not need
    from mmidx.images.transform import num_image_tokens

    dataset = prefix if isinstance(prefix, MMIDXDataset) else MMIDXDataset(prefix)
    if not 0 <= index < len(dataset):
        raise ValueError(f"{dataset.prefix}: sample {index} out of range: the dataset has {len(dataset):,} samples")
    sample = dataset[index]
    if not 0 <= view < sample.num_views:
        raise ValueError(f"{dataset.prefix}: view {view} out of range: sample {index} has {sample.num_views} "
                         f"view{'s' if sample.num_views != 1 else ''}")
    tokenizer, no_tokenizer = dataset_tokenizer(dataset) if tokenizer is None else tokenizer
    config = config_for([dataset.prefix])  # BAGEL's transforms for the dataset's source type
    group, geometry = config.groups[0], config.geometry
    images = []
    folder = Path(output_dir) if output_dir is not None else None
    if folder is not None:
        for j, image in enumerate(sample.images):  # every image checked before any is written
            _check_decodes(dataset, index, j, image.data)
        folder.mkdir(parents=True, exist_ok=True)
    for j, image in enumerate(sample.images):
        entry = {"image": j, "width": image.width, "height": image.height, "format": image.format,
                 "mode": image.mode, "bytes": len(image.data)}
        if folder is not None:
            path = folder / f"sample{index}_image{j}.{EXTENSIONS.get(image.format, 'bin')}"
            path.write_bytes(image.data)
            entry["file"] = str(path)
        images.append(entry)
    elements = []
    for record, plan in zip(sample.elements(view), sample.sequence_plan(view), strict=True):
        element = {key: plan[key] for key in ("type", "loss", "enable_cfg", "special_token_loss",
                                              "special_token_label", "split_start", "split_end", "img_num")}
        element["frame_delta"] = plan.get("frame_delta")
        payload = int(record["payload"])
        if record["kind"] == fmt.TEXT:
            ids = sample.text(payload)
            shown = ids if max_text_tokens is None else ids[:max_text_tokens]
            element.update(text=payload, tokens=len(ids) + 2, shown_tokens=len(shown), token_ids=shown.tolist(),
                           decoded=tokenizer.decode(shown) if tokenizer is not None else None)
        else:
            vae = record["kind"] == fmt.VAE_IMAGE
            transform = group.vae_transform if vae else group.vit_transform
            patch = geometry.vae_image_downsample if vae else geometry.vit_patch_size
            image = sample.image(payload)
            element["image"] = payload
            element["tokens"] = None if transform is None else int(num_image_tokens(
                np.array([image.width]), np.array([image.height]), transform, img_nums=np.array([plan["img_num"]]),
                patch_size=patch)[0]) + 2
        elements.append(element)
    source, row = sample.origin
    counted = [e["tokens"] for e in elements]
    return {"dataset": dataset.prefix, "sample": index, "samples": len(dataset), "view": view,
            "views": sample.num_views, "source": ((dataset.metadata or {}).get("build") or {}).get("source"),
            "origin": {"file": source, "row": row} if source is not None else None,
            "tokens": None if None in counted else sum(counted), "elements": elements, "images": images,
            "extra": sample.extra, "tokenizer_note": no_tokenizer}


def element_flags(element: dict[str, Any]) -> str:
    """An element's flags as a person reads them: ``loss, enable_cfg, split_start, frame_delta 2`` ("-": none)."""
    names = [name for name in ("loss", "enable_cfg", "special_token_loss", "split_start", "split_end")
             if element[name]]
    if element["frame_delta"] is not None:
        names.append(f"frame_delta {element['frame_delta']}")
    if element["special_token_label"] is not None:
        names.append(f"label {element['special_token_label']}")
    if element["img_num"] != 1:
        names.append(f"img_num {element['img_num']}")
    return ", ".join(names) or "-"


def _check_decodes(dataset: MMIDXDataset, index: int, number: int, data: memoryview) -> None:
    """Refuse to write out an image that does not decode: a file that looks like an image but is not one
    would hide that the dataset is damaged."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(bytes(data))) as image:
            image.load()
    except Exception as error:  # whatever PIL raises for bytes that are not a whole image
        raise ValueError(f"{dataset.prefix}: image {number} of sample {index} does not decode ({error}); nothing "
                         f"written: the dataset may be damaged, run mmidx verify --decode {dataset.prefix}") from None


def format_sample(info: dict[str, Any]) -> str:
    """The human-readable form of :func:`describe_sample`."""
    plural = "s" if info["views"] != 1 else ""
    lines = [f"{info['dataset']}: sample {info['sample']:,} of {info['samples']:,}, view {info['view']} of "
             f"{info['views']} view{plural}" + (f" ({info['source']} source)" if info["source"] else "")]
    origin = info["origin"]
    lines.append(f"  origin    {origin['file']} row {origin['row']}" if origin else "  origin    not recorded")
    total = f"{info['tokens']:,}" if info["tokens"] is not None else "unknown (no transform for an image kind)"
    lines.append(f"  tokens    {total} when packed (elements with their framing tokens)")
    if info["tokenizer_note"]:
        lines.append(f"  texts     shown as token ids: {info['tokenizer_note']}")
    if any(element["type"] == "text" for element in info["elements"]):
        lines.append(f"  loss      text after {LOSS_MARK} carries loss, after {MASKED_MARK} is context only (masked)")
    lines.append(f"  {'#':>3}  {'kind':<10} {'tokens':>7}  flags")
    for number, element in enumerate(info["elements"]):
        tokens = f"{element['tokens']:,}" if element["tokens"] is not None else "?"
        lines.append(f"  {number:>3}  {element['type']:<10} {tokens:>7}  {element_flags(element)}")
        if element["type"] == "text":
            text = element["decoded"] if element["decoded"] is not None else str(element["token_ids"])
            mark = LOSS_MARK if element["loss"] else MASKED_MARK
            lines += [f"{'':>8}{mark} {line}" for line in text.splitlines() or [""]]
        else:
            image = info["images"][element["image"]]
            lines.append(f"{'':>8}│ image {element['image']}: {image['width']}x{image['height']} {image['format']}")
    for image in info["images"]:
        where = f"  → {image['file']}" if "file" in image else ""
        lines.append(f"  image {image['image']}  {image['width']}x{image['height']} {image['format']} {image['mode']}, "
                     f"{image['bytes']:,} bytes{where}")
    if info["extra"]:
        lines.append(f"  extra     {json.dumps(info['extra'], ensure_ascii=False)}")
    return "\n".join(lines)
