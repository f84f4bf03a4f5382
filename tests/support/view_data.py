"""A small dataset for the viewer's tests, with what they look for planted in it.

60 samples (more than one page of the grid) with captions built with the test tokenizer, images of
several sizes and formats (one TIFF, which browsers cannot show as stored), a sample with two views
and two images, a text-only sample, a caption with markup in it (``PLANTED_CAPTION``, on the grid's
second page, so only the search finds it), and a build report with skips and fetch outcomes.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmidx.ingest.report import report_path
from mmidx.ingest.writer import DatasetBuilder
from mmidx.sources.elements import Element, StoredImage
from support.sources import image_bytes, loaded_tokenizer

SAMPLES = 60
PLANTED_SAMPLE = 57
PLANTED_WORD = "zebraquartz"
PLANTED_CAPTION = f"a {PLANTED_WORD} <script>alert('planted')</script> & <b>bold</b> friends"
TWO_VIEWS_SAMPLE = 5
TEXT_ONLY_SAMPLE = 7
TIFF_SAMPLE = 9
SIZES = [(64, 48), (48, 64), (80, 80), (96, 40), (40, 96)]
FORMATS = ["JPEG", "PNG", "WEBP"]
REPORT = {
    "output": "", "ok": True, "message": "skipped 4.76% of the rows (limit 10.00%)", "rows": 63, "samples": SAMPLES,
    "skipped": 3, "warned": 0, "views": 0, "images": 0, "tokens": 0, "units": 1, "reused_units": 0,
    "seconds": {"wall": 0.1}, "reasons": {"fetch:not_found": "the server answered 404 or 410"},
    "skips": {"fetch:not_found": {"count": 2, "examples": [{"file": "urls.parquet", "row": 3,
                                                            "detail": "HTTP 404 for <http://example.invalid/a.jpg>"}]},
              "undecodable_image": {"count": 1, "examples": [{"file": "urls.parquet", "row": 8,
                                                              "detail": "not an image: <html>"}]}},
    "warnings": {},
}


def caption(index: int) -> str:
    """The caption of sample ``index``."""
    return PLANTED_CAPTION if index == PLANTED_SAMPLE else f"photo of a small red house number {index}"


def build_planted_dataset(folder: Path) -> Path:
    """Build the dataset (once per folder) and return its prefix."""
    prefix = Path(folder) / "planted"
    if Path(f"{prefix}.meta.json").exists():
        return prefix
    tokenizer = loaded_tokenizer()
    with DatasetBuilder(prefix, vocab_size=tokenizer.vocab_size, tokenizer=tokenizer.identity,
                        special_tokens=tokenizer.special_tokens, build_config={"source": "t2i"}) as builder:
        source = builder.source_id("planted.parquet")
        for index in range(SAMPLES):
            texts = [tokenizer.encode(caption(index))]
            width, height = SIZES[index % len(SIZES)]
            format_ = "TIFF" if index == TIFF_SAMPLE else FORMATS[index % len(FORMATS)]
            images = [StoredImage(image_bytes(width, height, fmt=format_, seed=index), width, height, format_, "RGB")]
            views = [[Element("text", 0, enable_cfg=True), Element("vae_image", 0, loss=True)]]
            if index == TWO_VIEWS_SAMPLE:
                texts.append(tokenizer.encode("make it blue"))
                images.append(StoredImage(image_bytes(64, 64, seed=1000), 64, 64, "JPEG", "RGB"))
                views.append([Element("vae_image", 0, enable_cfg=True), Element("text", 1),
                              Element("vae_image", 1, loss=True)])
            if index == TEXT_ONLY_SAMPLE:
                images, views = [], [[Element("text", 0, loss=True)]]
            builder.add_sample(texts, images, views, origin=(source, index))
        builder.finalize()
    report_path(prefix).write_text(json.dumps({**REPORT, "output": str(prefix)}))
    return prefix


def write_data_yaml(folder: Path, prefix: Path) -> Path:
    """A data YAML of one group holding the planted dataset: small images, small packs, no CFG dropout (so a
    pack's batch has exactly the tokens the index planned)."""
    path = Path(folder) / "data.yaml"
    path.write_text(json.dumps({  # JSON is YAML
        "groups": {"planted_t2i": {"datasets": [Path(prefix).name], "weight": 1.0, "is_mandatory": True,
                                   "image_transform_args": {"image_stride": 16, "max_image_size": 256,
                                                            "min_image_size": 64}}},
        "packing": {"expected_num_tokens": 1024, "max_num_tokens": 1536, "max_num_tokens_per_sample": 1024,
                    "prefer_buffer_before": 512},
        "dropout": {"text": 0.0, "vit": 0.0, "vae": 0.0},
    }))
    return path
