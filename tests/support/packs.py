"""A small multimodal pack stream for the trainer-framework tests, and an exact comparison of batches.

The datasets are BAGEL-shaped (t2i: captions and VAE images; vlm: ViT images and a text answer with
loss), with CFG dropout on, so each pack is a mix of keys whose values depend on the pack number.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from PIL import Image

from mmidx.config import DataConfig
from mmidx.index.pack_index import build_pack_index
from mmidx.ingest.writer import DatasetBuilder
from mmidx.pack.batch import PackedBatch
from mmidx.pack.builder import PackBuilder
from mmidx.sources.elements import Element, StoredImage
from mmidx.train.loader import PackDataset

SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4}
NUM_SAMPLES = 120  # the stream: about 30 packs


def _image(rng: np.random.Generator) -> StoredImage:
    width, height = (int(v) for v in rng.integers(40, 120, 2))
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
    return StoredImage(buffer.getvalue(), width, height, "PNG", "RGB")


def _text(rng: np.random.Generator) -> list[int]:
    return rng.integers(10, 500, int(rng.integers(1, 30))).tolist()


def write_data_config(folder: Path) -> Path:
    """Build the datasets under ``folder`` and write the ``data.yaml`` that mixes them; returns its path."""
    rng = np.random.default_rng(27)
    with DatasetBuilder(folder / "t2i", vocab_size=1000, special_tokens=SPECIAL) as builder:
        for _ in range(6):
            builder.add_sample([_text(rng), _text(rng)], [_image(rng)],
                               [[Element("text", v, enable_cfg=True), Element("vae_image", 0, loss=True)]
                                for v in range(2)])
        builder.finalize()
    with DatasetBuilder(folder / "vlm", vocab_size=1000, special_tokens=SPECIAL) as builder:
        for _ in range(6):
            builder.add_sample([_text(rng), _text(rng)], [_image(rng)],
                               [[Element("text", 0), Element("vit_image", 0, img_num=1, enable_cfg=True),
                                 Element("text", 1, loss=True)]])
        builder.finalize()
    config = {
        "groups": {
            "t2i": {"datasets": ["t2i"], "image_transform_args": {"image_stride": 16, "max_image_size": 64,
                                                                  "min_image_size": 32}, "weight": 1.0},
            "vlm": {"datasets": ["vlm"], "vit_image_transform_args": {"image_stride": 14, "max_image_size": 56,
                                                                      "min_image_size": 28}, "weight": 1.0},
        },
        "packing": {"max_num_tokens": 240, "expected_num_tokens": 160, "max_num_tokens_per_sample": 240,
                    "prefer_buffer_before": 80, "max_buffer_size": 4},
        "dropout": {"text": 0.3, "vit": 0.3, "vae": 0.3},
        "geometry": {"vit_patch_size": 14, "max_num_patch_per_side": 70, "vae_image_downsample": 16,
                     "max_latent_size": 64},
        "seed": 5,
    }
    path = folder / "data.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def pack_dataset(config_path: Path | str, cache_dir: Path | str | None = None) -> PackDataset:
    """The packs of ``config_path``'s stream (dense masks, so they are compared too)."""
    config = DataConfig.from_yaml(config_path)
    index = build_pack_index(config, num_samples=NUM_SAMPLES, cache_dir=cache_dir, progress=False)
    return PackDataset(index, PackBuilder(config, use_flex=False))


def record(batch: PackedBatch | dict[str, Any]) -> dict[str, Any]:
    """Everything a trainer sees of a batch: BAGEL's dict (tensors, masks, metadata), on the CPU."""
    return batch.to_dict() if isinstance(batch, PackedBatch) else batch


def _same(got: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), f"{where}: keys {sorted(got)} != {sorted(expected)}"
        for key in expected:
            _same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(expected), f"{where}: {got!r} != {expected!r}"
        for position, (a, b) in enumerate(zip(got, expected, strict=True)):
            _same(a, b, f"{where}[{position}]")
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def assert_same_batches(got: list, expected: list, *, drop_worker_ids: bool = False) -> None:
    """Each batch equal to the expected one in every key (tensors with ``torch.equal``), and as many.

    ``drop_worker_ids``: compare ``batch_data_indexes`` without ``worker_id`` (which DataLoader worker
    built a pack), for runs with different worker counts."""
    assert len(got) == len(expected), f"{len(got)} batches, expected {len(expected)}"
    for number, (a, b) in enumerate(zip(got, expected, strict=True)):
        a, b = record(a), record(b)
        if drop_worker_ids:
            a, b = ({**d, "batch_data_indexes": [{k: v for k, v in entry.items() if k != "worker_id"}
                                                 for entry in d["batch_data_indexes"]]} for d in (a, b))
        _same(a, b, f"batch {number}")


def position(state: dict[str, Any]) -> dict[str, Any]:
    """Where a loader state is: the packs consumed and the shares, without the stream it names."""
    return {key: state[key] for key in ("packs_consumed", "world_size", "global_batch_size")}


def take(iterable, count: int) -> list:
    """The first ``count`` items of ``iterable`` (a loader), without drawing one more."""
    taken = []
    for item in iterable:
        taken.append(item)
        if len(taken) == count:
            break
    return taken
