"""mmidx's packed batches equal a naive reference of BAGEL's per-sample rules, key by key.

The reference (``support/bagel_reference.py``) was written from the same spec as mmidx's packing and takes mmidx's
samples, plans and draws as input: it checks the optimised code against the naive reading of the spec, not
against BAGEL (``tools/check_bagel.py`` compares with BAGEL's own code)."""


import numpy as np
import pytest
import torch
from support.packing import GEOMETRY, assert_same, build_groups, reference_batch

from mmidx.config import DataConfig
from mmidx.index.pack_index import PackItem
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return build_groups(tmp_path_factory.mktemp("packing"))


@pytest.mark.parametrize("use_flex", [True, False])
@pytest.mark.parametrize("dropout", [{"text": 0.0, "vit": 0.0, "vae": 0.0}, {"text": 0.5, "vit": 0.5, "vae": 0.5}])
def test_packs_of_every_type_and_mixture_equal_the_reference(groups, use_flex, dropout):
    config = DataConfig.from_dict({"groups": groups, "dropout": dropout, "geometry": GEOMETRY, "seed": 5,
                                   "packing": {"max_num_tokens": 8192, "expected_num_tokens": 4096,
                                               "max_num_tokens_per_sample": 4096}})
    builder = PackBuilder(config, use_flex=use_flex)
    rng = np.random.default_rng(1)
    sizes = [len(MMIDXDataset(spec["datasets"][0])) for spec in groups.values()]
    packs = [[PackItem(0, 0, i, i % 2) for i in range(4)],                       # t2i only, both views
             [PackItem(1, 0, i, 0) for i in range(3)],                           # edit only
             [PackItem(2, 0, i, 0) for i in range(3)]]                           # vlm incl. video clip
    packs += [[PackItem(int(g), 0, int(rng.integers(sizes[g])), 0) for g in rng.integers(0, 3, 5)]
              for _ in range(4)]                                                 # mixtures
    for pack_index, items in enumerate(packs):
        ours = builder.build(pack_index, items).to_dict()
        assert_same(ours, reference_batch(config, items, pack_index, use_flex, groups))


def test_dropout_decisions_depend_only_on_seed_pack_and_position(groups):
    config = DataConfig.from_dict({"groups": groups, "geometry": GEOMETRY, "dropout": {"text": 0.5, "vae": 0.5}})
    builder = PackBuilder(config)
    items = [PackItem(1, 0, i, 0) for i in range(3)]
    first = builder.build(7, items).to_dict()
    again = PackBuilder(config).build(7, items).to_dict()
    other = builder.build(8, items).to_dict()
    assert torch.equal(first["packed_position_ids"], again["packed_position_ids"])
    assert torch.equal(first["packed_timesteps"], again["packed_timesteps"])
    def noised(batch):
        return batch["packed_timesteps"][torch.isfinite(batch["packed_timesteps"])].unique()

    assert len(noised(first)) > 0 and not torch.equal(noised(first), noised(other))
