"""The pack index: exact per-view sizes, whole samples in budget, a cache keyed by what it depends on."""

import numpy as np
import pytest
from test_packing_reference import GEOMETRY, build_groups

from mmidx.config import DataConfig
from mmidx.dataset import MMIDXDataset
from mmidx.pack_index import build_pack_index, view_token_counts
from mmidx.packing import PackBuilder

PACKING = {"max_num_tokens": 3000, "expected_num_tokens": 2000, "max_num_tokens_per_sample": 2500,
           "prefer_buffer_before": 1000, "max_buffer_size": 4}


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return build_groups(tmp_path_factory.mktemp("index"))


def config_of(groups, **overrides):
    return DataConfig.from_dict({"groups": groups, "geometry": GEOMETRY, "packing": PACKING,
                                 "dropout": {"text": 0.0, "vit": 0.0, "vae": 0.0}, **overrides})


def test_view_sizes_equal_the_length_of_the_packed_sample(groups):
    config = config_of(groups)
    builder = PackBuilder(config)
    for g, group in enumerate(config.groups):
        dataset = MMIDXDataset(group.datasets[0])
        view_offsets, view_tokens = view_token_counts(dataset, group, config.geometry)
        for sample in range(len(dataset)):
            for view in range(dataset[sample].num_views):
                from mmidx.packing import PackItem
                batch = builder.build(0, [PackItem(g, 0, sample, view)])
                assert batch.sequence_length == view_tokens[view_offsets[sample] + view]


def test_every_sample_of_the_stream_is_packed_once_within_budget(groups, tmp_path):
    config = config_of(groups)
    index = build_pack_index(config, num_samples=60, cache_dir=tmp_path)
    packed = np.concatenate([index.arrays["pack_items"], index.arrays["excluded"]])
    assert sorted(packed.tolist()) == list(range(60))
    offsets = index.arrays["pack_offsets"]
    tokens = index.arrays["stream_tokens"]
    for k in range(len(index)):
        assert tokens[index.arrays["pack_items"][offsets[k]:offsets[k + 1]]].sum() <= PACKING["max_num_tokens"]
    assert index.stats["num_packs"] == len(index)


def test_mandatory_group_starts_every_pack(groups, tmp_path):
    index = build_pack_index(config_of(groups), num_samples=60)
    mandatory = [g for g, group in enumerate(index.config.groups) if group.is_mandatory]
    assert mandatory == [0]
    starts = [index.items(k)[0].group for k in range(len(index) - 1)]
    assert all(group == 0 for group in starts)


def test_cache_is_reused_and_keyed_by_config(groups, tmp_path):
    first = build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path)
    again = build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path)
    assert again.path == first.path and isinstance(again.arrays["pack_items"], np.memmap)
    assert all(np.array_equal(first.arrays[k], again.arrays[k]) for k in first.arrays)
    other_seed = build_pack_index(config_of(groups, seed=1), num_samples=40, cache_dir=tmp_path)
    longer = build_pack_index(config_of(groups), num_samples=41, cache_dir=tmp_path)
    assert len({first.path, other_seed.path, longer.path}) == 3
    assert not list(tmp_path.glob("*.partial-*"))


def test_items_name_views_that_exist(groups):
    index = build_pack_index(config_of(groups), num_samples=80)
    for k in range(len(index)):
        for item in index.items(k):
            sample = MMIDXDataset(index.config.groups[item.group].datasets[item.dataset])[item.sample]
            assert 0 <= item.view < sample.num_views
