"""A pack's precached records are located, checked and copied all at once (:mod:`mmidx.encodings.gather`,
:mod:`mmidx._gather`): the copy kernel writes what numpy slicing writes and refuses what does not fit; the
vectorised record checks refuse exactly the records the one-record reader refuses; packs of records stored in
other dtypes take the per-record path with the same values; and a later batch never overwrites one still used.
"""

import dataclasses

import numpy as np
import pytest
import torch
from support.precache import SPECIAL, VAE, make_datasets

from mmidx import _gather
from mmidx import format as fmt
from mmidx.config import DataConfig, DropoutConfig, GroupConfig
from mmidx.encodings.encode import Job
from mmidx.encodings.gather import record_problems
from mmidx.encodings.precache import precache_dataset
from mmidx.format import FormatError
from mmidx.images.transform import ImageTransform
from mmidx.index.pack_index import PackItem
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.encoding_streams import EncodingStream
from mmidx.toolkit.bench import STAGES, StageClock

VIT = ImageTransform(max_image_size=56, min_image_size=28, image_stride=14)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = make_datasets(tmp_path_factory.mktemp("gather"))
    for dtype in ("bf16", "fp32"):
        precache_dataset(str(folder / "edit"), Job(f"vit_{dtype}", "support.encoders:vit", transform="vit",
                                                   dtype=dtype, batch_size=2), VIT, progress=False)
    for name in ("t2i", "edit"):
        precache_dataset(str(folder / name), Job("moments", "support.encoders:vae", batch_size=3), VAE, progress=False)
    return folder


def _arrays(*columns):
    return [np.ascontiguousarray(column, dtype=np.int64) for column in columns]


def test_copy_records_writes_each_record_where_numpy_slicing_writes_it():
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    # packed: runs of every size class (below the streaming threshold, unaligned, whole 64-byte blocks and tails)
    sizes = [0, 1, 17, 255, 256, 300, 4096, 65600, 200003]
    offsets = rng.integers(0, len(source) - max(sizes), len(sizes))
    destinations = np.cumsum([0, *sizes[:-1]]) + 3  # an unaligned start
    out, expected = np.zeros(sum(sizes) + 10, np.uint8), np.zeros(sum(sizes) + 10, np.uint8)
    ones = np.ones(len(sizes))
    _gather.copy_records(source, *_arrays(offsets), out, *_arrays(destinations, ones, ones, sizes), 0, 0)
    for offset, destination, size in zip(offsets, destinations, sizes, strict=True):
        expected[destination:destination + size] = source[offset:offset + size]
    assert np.array_equal(out, expected)
    # padded: (planes, h, w) records into the top-left corners of (planes, 9, 300) slots
    shapes = [(2, 9, 300), (3, 4, 100), (1, 9, 7)]
    slot = 3 * 9 * 300
    out, expected = np.zeros(len(shapes) * slot, np.uint8), np.zeros((len(shapes), 3, 9, 300), np.uint8)
    offsets = [0, 10000, 70001]
    _gather.copy_records(source, *_arrays(offsets), out, *_arrays(np.arange(len(shapes)) * slot,
                                                                   *zip(*shapes, strict=True)), 9 * 300, 300)
    for number, ((planes, h, w), offset) in enumerate(zip(shapes, offsets, strict=True)):
        expected[number, :planes, :h, :w] = source[offset:offset + planes * h * w].reshape(planes, h, w)
    assert np.array_equal(out, expected.reshape(-1))


def test_copy_records_refuses_ranges_outside_either_buffer_and_copies_nothing():
    source, out = np.arange(100, dtype=np.uint8), np.zeros(50, np.uint8)
    cases = [((0, 60), (0, 0), (1, 1), (1, 1), (40, 41)),     # the second ends past the source
             ((0, 0), (0, 20), (1, 1), (1, 1), (10, 40)),     # the second ends past the output
             ((0, -1), (0, 0), (1, 1), (1, 1), (10, 1)),      # a negative offset
             ((0, 0), (0, 0), (1, 2), (1, 3), (10, 20))]      # rows wider than their stride overlap
    for offsets, destinations, planes, rows, row_bytes in cases:
        with pytest.raises(ValueError, match="copy_records"):
            _gather.copy_records(source, *_arrays(offsets), out, *_arrays(destinations, planes, rows, row_bytes),
                                 25, 10)
        assert not out.any()


def test_record_problems_refuses_exactly_the_records_the_reader_refuses(data):
    stream = EncodingStream.open(str(data / "edit"), "moments")
    rng = np.random.default_rng(1)
    corruptions = [("ndim", 0), ("ndim", 5), ("ndim", 3), ("shape", -1), ("shape", 2**31 - 1), ("offset", -64),
                   ("offset", 3), ("offset", 1 << 40), ("nbytes", 0), ("nbytes", -8), ("nbytes", 1 << 62)]
    answers = set()
    for trial in range(200):
        records = stream.records.copy()
        if trial % 4:
            field, value = corruptions[trial % len(corruptions)]
            number = int(rng.integers(0, len(records)))
            if field == "shape":
                records["shape"][number, rng.integers(0, 4)] = value
            else:
                records[field][number] = value
        corrupted = dataclasses.replace(stream, records=records)
        vectorised = record_problems(corrupted, records)
        for number, refused in enumerate(vectorised.tolist()):
            try:
                corrupted.view(number)
                reader_refuses = False
            except FormatError:
                reader_refuses = True
            assert refused == reader_refuses, (trial, number, records[number])
            answers.add(refused)
    assert answers == {True, False}


def _config(folder, vit_streams, dropout=True):
    groups = [GroupConfig("t2i", (str(folder / "t2i"),), image_transform=VAE, encodings=(("vae", "moments"),))]
    groups += [GroupConfig(f"edit_{name}", (str(folder / "edit"),), image_transform=VAE, vit_image_transform=VIT,
                           encodings=(("vae", "moments"), ("vit", name))) for name in vit_streams]
    config = DataConfig(groups=tuple(groups), seed=3)
    return config if dropout else dataclasses.replace(config, dropout=DropoutConfig(0, 0, 0))


def _stored_vit(folder, name, pack):
    """The ViT records of ``pack``'s edit samples, read one by one, in token order (no dropout)."""
    values = []
    for entry in pack.batch_data_indexes:
        sample = MMIDXDataset(folder / "edit")[entry["sample"]]
        for record in sample.elements(entry["view"]):
            if record["kind"] == fmt.VIT_IMAGE:
                value = sample.encoding(name, int(record["payload"]), int(record["img_num"]))
                values.append(value.reshape(-1, value.shape[-1]))
    return torch.cat(values)


def test_groups_precached_in_other_dtypes_ship_float32_records_read_one_by_one(data):
    builder = PackBuilder(_config(data, ("vit_bf16", "vit_fp32"), dropout=False), special_tokens=SPECIAL)
    bf16, fp32 = [PackItem(1, 0, 0, 0), PackItem(1, 0, 1, 0)], [PackItem(2, 0, 2, 0), PackItem(2, 0, 3, 0)]
    pack = builder.build(0, bf16 + fp32)
    assert pack.tensors["packed_vit_embeddings_stored"].dtype == torch.float32
    expected = torch.cat([_stored_vit(data, "vit_bf16", builder.build(1, bf16)).float(),
                          _stored_vit(data, "vit_fp32", builder.build(2, fp32))])
    assert torch.equal(pack.tensors["packed_vit_embeddings_stored"], expected)
    single = builder.build(3, bf16)  # one dtype: the records' bytes, as stored
    assert single.tensors["packed_vit_embeddings_stored"].dtype == torch.bfloat16
    assert torch.equal(single.tensors["packed_vit_embeddings_stored"], _stored_vit(data, "vit_bf16", single))


def test_a_later_batch_never_overwrites_a_batch_still_in_use(data):
    builder = PackBuilder(_config(data, ("vit_bf16",), dropout=False), special_tokens=SPECIAL)
    items = [[PackItem(1, 0, s, 0), PackItem(0, 0, (s + k) % 6, 0)] for k in range(6) for s in range(4)]
    kept = builder.build(0, items[0])
    copies = {key: value.clone() for key, value in kept.tensors.items() if isinstance(value, torch.Tensor)}
    assert "packed_vit_embeddings_stored" in copies and "padded_latent_moments" in copies
    later = [builder.build(k, chosen) for k, chosen in enumerate(items[1:], 1)]  # some still held, some dropped
    for k in range(1, len(items)):
        builder.build(k, items[k])
    for key, value in copies.items():
        assert torch.equal(kept.tensors[key], value), key
    addresses = {kept.tensors[key].data_ptr() for key in ("packed_vit_embeddings_stored", "padded_latent_moments")}
    for batch in later:
        for key in ("packed_vit_embeddings_stored", "padded_latent_moments"):
            assert batch.tensors[key].data_ptr() not in addresses, key


def test_a_timed_build_of_precached_records_times_them_under_the_benchmarks_stages(data):
    """`mmidx bench` breaks a pack's time down by its stages' names: time under another name goes uncounted."""
    clock = StageClock()
    builder = PackBuilder(_config(data, ("vit_bf16",), dropout=False), special_tokens=SPECIAL, stage=clock)
    builder.build(0, [PackItem(1, 0, 0, 0), PackItem(0, 0, 1, 0)])
    assert "assemble" in clock.seconds and set(clock.seconds) <= set(STAGES)
