"""Packed-batch test data: datasets of the four shapes (t2i, edit, vlm, chat) with BAGEL's transforms, and the
helpers that build reference batches and compare packed batches."""

import functools
import io
import random

import numpy as np
import torch
from PIL import Image

from mmidx.config import DataConfig
from mmidx.index.dropout import sample_randomness
from mmidx.ingest.writer import DatasetBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources.elements import Element, StoredImage
from mmidx.toolkit.synthetic import photo_jpeg
from support.bagel_reference import pack as reference_pack

SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4}


VAE = {"image_stride": 16, "max_image_size": 128, "min_image_size": 64}


VIT = {"image_stride": 14, "max_image_size": 112, "min_image_size": 56}


VLM = {"image_stride": 14, "max_image_size": 140, "min_image_size": 56, "max_pixels": 20000}


GEOMETRY = {"vit_patch_size": 14, "max_num_patch_per_side": 70, "vae_image_downsample": 16, "max_latent_size": 64}


def _encoded(rng, mode, photo=False):
    """A stored image of random size and ``mode``: pure noise (the hardest case for exactness), or a
    photo-like picture (smooth fields, shapes) when ``photo``."""
    width, height = (int(v) for v in rng.integers(40, 200, 2))
    if photo:
        rgb = Image.open(io.BytesIO(photo_jpeg(random.Random(int(rng.integers(1 << 30))), width, height, 90)))
        image = rgb.convert("RGBA")
        image.putalpha(int(rng.integers(192, 256)))  # RGBA images are composited on white
    else:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode != "RGBA":
        image = image.convert(mode)
    buffer, fmt_name = io.BytesIO(), "PNG" if mode in ("RGBA", "P", "L") else "JPEG"
    image.save(buffer, fmt_name)
    saved = Image.open(buffer)  # described as stored (DatasetBuilder checks it): transparency as read back
    return StoredImage(buffer.getvalue(), width, height, fmt_name, mode, saved.has_transparency_data)


def text(rng):
    return rng.integers(10, 500, rng.integers(0, 12)).tolist()


def build_groups(tmp_path, photo=False):
    """Datasets shaped like t2i, edit, vlm (with multi-image and video-like clips) and chat."""
    rng = np.random.default_rng(0)
    encoded = functools.partial(_encoded, photo=photo)
    with DatasetBuilder(tmp_path / "t2i", vocab_size=1000, special_tokens=SPECIAL) as builder:
        for _ in range(4):
            builder.add_sample([text(rng), text(rng)], [encoded(rng, "RGB")],
                               [[Element("text", v, enable_cfg=True), Element("vae_image", 0, loss=True)]
                                for v in range(2)])
        builder.finalize()
    with DatasetBuilder(tmp_path / "edit", vocab_size=1000, special_tokens=SPECIAL) as builder:
        for _ in range(3):
            images = [encoded(rng, mode) for mode in ("RGB", "RGBA", "P")]
            steps = [Element("vae_image", 0, enable_cfg=True), Element("vit_image", 0, enable_cfg=True)]
            for k in (1, 2):
                steps += [Element("text", k - 1, enable_cfg=True), Element("vae_image", k, loss=True)]
                if k == 1:
                    steps += [Element("vae_image", 1, enable_cfg=True), Element("vit_image", 1, enable_cfg=True)]
            builder.add_sample([text(rng), text(rng)], images, [steps])
        builder.finalize()
    with DatasetBuilder(tmp_path / "vlm", vocab_size=1000, special_tokens=SPECIAL) as builder:
        for n in (1, 3):
            images = [encoded(rng, "L") for _ in range(n)]
            plan = [Element("text", 0)] + [Element("vit_image", j, img_num=n) for j in range(n)]
            plan += [Element("text", 1, loss=True, special_token_loss=True, special_token_label=7)]
            builder.add_sample([text(rng), text(rng)], images, [plan])
        frames = [encoded(rng, "RGB") for _ in range(3)]
        clip = [Element("vae_image", j, loss=True, split_start=j == 0, split_end=j == 2,
                        frame_delta=2 if j < 2 else None) for j in range(3)]
        builder.add_sample([text(rng)], frames, [[Element("text", 0, loss=True), *clip]])
        builder.finalize()
    groups = {
        "t2i": {"datasets": [str(tmp_path / "t2i")], "image_transform_args": VAE, "is_mandatory": True},
        "edit": {"datasets": [str(tmp_path / "edit")], "image_transform_args": VAE, "vit_image_transform_args": VIT},
        "vlm": {"datasets": [str(tmp_path / "vlm")], "image_transform_args": VLM},
    }
    return groups


def reference_batch(config, items, pack_index, use_flex, groups):
    group_args = list(groups.values())
    samples = []
    for position, item in enumerate(items):
        sample = MMIDXDataset(config.groups[item.group].datasets[item.dataset])[item.sample]
        plan = sample.sequence_plan(item.view)
        uniforms, normals = sample_randomness(config.seed, pack_index, position, len(plan))
        args = group_args[item.group]
        samples.append({"plan": plan, "texts": sample.texts, "images": [image.data for image in sample.images],
                        "uniforms": uniforms.tolist(), "normals": normals.tolist(),
                        "vae_args": args["image_transform_args"],
                        "vit_args": args.get("vit_image_transform_args", args["image_transform_args"])})
    dropout = {"text": config.dropout.text, "vit": config.dropout.vit, "vae": config.dropout.vae}
    return reference_pack(samples, SPECIAL, dropout, GEOMETRY, config.packing.max_num_tokens, use_flex)


def assert_same(ours, expected):
    assert sorted(ours) == sorted(set(expected) | {"batch_data_indexes"})
    for key, value in expected.items():
        got = ours[key]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype, key
            assert torch.equal(got, value), key
        elif key == "nested_attention_masks":
            assert len(got) == len(value)
            assert all(torch.equal(a, b) for a, b in zip(got, value, strict=True))
        else:
            assert got == value, key


PACKING = {"max_num_tokens": 3000, "expected_num_tokens": 2000, "max_num_tokens_per_sample": 2500,
           "prefer_buffer_before": 1000, "max_buffer_size": 4}


def config_of(groups, **overrides):
    return DataConfig.from_dict({"groups": groups, "geometry": GEOMETRY, "packing": PACKING,
                                 "dropout": {"text": 0.0, "vit": 0.0, "vae": 0.0}, **overrides})
