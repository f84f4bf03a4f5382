"""Precached ViT encodings ship from the loader in their stored dtype and are widened to the float32
``packed_vit_embeddings`` where the batch is read: what a trainer reads is the stored records widened,
bit for bit, with every other key unchanged."""

import dataclasses

import pytest
import torch
from support.precache import SPECIAL, VAE, make_datasets

from mmidx.config import DataConfig, DropoutConfig, GroupConfig
from mmidx.encodings.encode import Job
from mmidx.encodings.precache import precache_dataset
from mmidx.images.transform import ImageTransform
from mmidx.index.pack_index import PackItem
from mmidx.pack.builder import PackBuilder

VIT = ImageTransform(max_image_size=56, min_image_size=28, image_stride=14)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = make_datasets(tmp_path_factory.mktemp("vit_shipped"))
    for dtype in DTYPES:  # one encoder, three stored dtypes: fp16/bf16 records are the fp32 ones rounded
        job = Job(f"vit_{dtype}", "support.encoders:vit", transform="vit", dtype=dtype, batch_size=2)
        precache_dataset(str(folder / "edit"), job, VIT, progress=False)
    return folder


def _builder(folder, dtype, dropout):
    config = DataConfig(groups=(GroupConfig("t2i", (str(folder / "t2i"),), image_transform=VAE),
                                GroupConfig("edit", (str(folder / "edit"),), image_transform=VAE,
                                            vit_image_transform=VIT, encodings=(("vit", f"vit_{dtype}"),))), seed=3)
    if not dropout:
        config = dataclasses.replace(config, dropout=DropoutConfig(0, 0, 0))
    return PackBuilder(config, special_tokens=SPECIAL)


def _item_lists():
    edits = [PackItem(1, 0, s, 0) for s in range(4)]
    return [edits, [*edits[1::2], PackItem(0, 0, 0, 0)], edits[::-1], [PackItem(0, 0, 1, 0), *edits[:2]]]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("dropout", [False, True])
def test_every_key_a_trainer_reads_is_the_stored_records_widened_bit_for_bit(data, dtype, dropout):
    wide, narrow = _builder(data, "fp32", dropout), _builder(data, dtype, dropout)
    compared = 0
    for k, items in enumerate(_item_lists()):
        shipped = narrow.build(k, items)
        if "packed_vit_token_indexes" not in shipped.tensors:
            continue  # every ViT image dropped
        assert "packed_vit_embeddings" not in shipped.tensors  # the worker does not widen
        assert shipped.tensors["packed_vit_embeddings_stored"].dtype == DTYPES[dtype]
        got = shipped.to("cpu").to_dict()
        want = wide.build(k, items).to("cpu").to_dict()
        assert "packed_vit_embeddings_stored" not in got and got.keys() == want.keys()
        assert got["packed_vit_embeddings"].dtype == torch.float32
        # the fp32 records rounded to the stored dtype, then widened: exactly what the pack read before
        assert torch.equal(got["packed_vit_embeddings"], want["packed_vit_embeddings"].to(DTYPES[dtype]).float())
        for key, value in want.items():
            if key != "packed_vit_embeddings":
                assert (torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value), key
        compared += 1
    assert compared >= 2


def test_the_batch_reads_widened_embeddings_without_an_explicit_move(data):
    items = _item_lists()[0]
    batch = _builder(data, "bf16", False).build(0, items)
    reference = _builder(data, "bf16", False).build(0, items).to("cpu").packed_vit_embeddings
    assert batch.packed_vit_embeddings.dtype == torch.float32  # attribute access widens where the batch is
    assert torch.equal(batch.packed_vit_embeddings, reference)
    assert "packed_vit_embeddings_stored" not in batch.tensors
    if torch.cuda.is_available():  # widened on the device the batch moves to, with the same values
        moved = _builder(data, "bf16", False).build(0, items).pin_memory().cuda()
        assert torch.equal(moved.packed_vit_embeddings.cpu(), reference)


def test_fp32_records_ship_as_float32(data):
    shipped = _builder(data, "fp32", False).build(0, _item_lists()[0])
    assert shipped.tensors["packed_vit_embeddings_stored"].dtype == torch.float32
    assert shipped.to("cpu").packed_vit_embeddings.dtype == torch.float32
