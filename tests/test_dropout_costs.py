"""Balanced steps deal each global batch by its packs' costs after CFG dropout, exactly as the packs are built.

``PackCosts`` repeats the builder's dropout decisions on the plan records (Philox uniforms evaluated in numpy) and
prices the kept tokens. The checks here are against what the builder writes (its ``sample_lens`` and ``split_lens``
for random packs and dropout settings) and against numpy's own Philox generator, never against the costs' own
code; then the deal made from them: the dearest built packs run together, the same on every rank, at every worker
count, and a pickled copy (a worker's) prices alike.
"""

import pickle
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.packing import GEOMETRY, SPECIAL, VAE, _encoded, build_groups
from support.packs import write_data_config

from mmidx import format as fmt
from mmidx.config import DataConfig, DropoutConfig
from mmidx.index.cost import QWEN2_1_5B, LLMGeometry
from mmidx.index.dropout import cfg_dropped, sample_randomness, sample_uniforms
from mmidx.index.pack_costs import PackCosts
from mmidx.index.pack_index import PackIndex, build_pack_index, pack_index_costs
from mmidx.index.sizes import view_token_counts
from mmidx.ingest.writer import DatasetBuilder
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources.elements import Element
from mmidx.train.loader import PackDataset, PackLoader
from mmidx.train.shares import GlobalBatchSampler
from mmidx.train.state import LoaderStateError

PACKING = {"max_num_tokens": 8192, "expected_num_tokens": 4096, "max_num_tokens_per_sample": 8192}


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**128 - 1), st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1),
                                                       st.integers(0, 70)), min_size=1, max_size=8))
def test_the_uniforms_of_many_samples_at_once_are_numpys_philox_draws(seed, wanted):
    packs, positions, elements = (np.array(column, dtype=np.int64) for column in zip(*wanted, strict=True))
    expected = [sample_randomness(seed, pack, position, element + 1)[0][element]
                for pack, position, element in wanted]
    assert sample_uniforms(seed, packs, positions, elements).tolist() == expected


def test_uniforms_refuse_what_philox_refuses():
    for seed in (-1, 2**128):
        with pytest.raises(ValueError, match="key"):
            sample_uniforms(seed, np.zeros(1), np.zeros(1), np.zeros(1))
    with pytest.raises(ValueError, match="non-negative"):
        sample_uniforms(0, np.zeros(1), np.array([-1]), np.zeros(1))


def test_an_element_is_dropped_only_with_enable_cfg_and_a_draw_below_its_kinds_probability():
    dropout = DropoutConfig(text=0.2, vit=0.5, vae=0.8)
    kinds = np.array([fmt.TEXT, fmt.TEXT, fmt.VIT_IMAGE, fmt.VIT_IMAGE, fmt.VAE_IMAGE, fmt.VAE_IMAGE, fmt.VAE_IMAGE])
    flags = np.array([fmt.FLAG_ENABLE_CFG] * 6 + [fmt.FLAG_LOSS])
    uniforms = np.array([0.19, 0.2, 0.49, 0.5, 0.79, 0.8, 0.0])
    assert cfg_dropped(kinds, flags, uniforms, dropout).tolist() == [True, False, True, False, True, False, False]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """t2i (two views), edit, vlm (multi-image, a clip without CFG), a clip whose frames CFG may drop (its split
    then opens and closes on kept frames) and a text dataset, each a group."""
    folder = tmp_path_factory.mktemp("dropout-costs")
    groups = build_groups(folder)
    rng = np.random.default_rng(5)
    with DatasetBuilder(folder / "video", vocab_size=1000, special_tokens=SPECIAL) as builder:
        for frames in (2, 4):
            clip = [Element("vae_image", j, enable_cfg=True, split_start=j == 0, split_end=j == frames - 1,
                            frame_delta=1 if j < frames - 1 else None) for j in range(frames)]
            plan = [Element("text", 0, enable_cfg=True), *clip, Element("vae_image", frames, loss=True)]
            builder.add_sample([rng.integers(10, 500, 7).tolist()], [_encoded(rng, "RGB") for _ in range(frames + 1)],
                               [plan])
        builder.finalize()
    with DatasetBuilder(folder / "text", kind="text", vocab_size=1000, special_tokens=SPECIAL) as builder:
        for count in (1, 2):
            builder.add_document([rng.integers(10, 500, int(rng.integers(1, 40))).tolist() for _ in range(count)])
        builder.finalize()
    return {**groups, "video": {"datasets": [str(folder / "video")], "image_transform_args": VAE},
            "text": {"datasets": [str(folder / "text")]}}


def index_of(config, packs):
    """An in-memory pack index whose pack k holds the (flat dataset number, sample, view) items ``packs[k]``."""
    datasets = [MMIDXDataset(prefix) for group in config.groups for prefix in group.datasets]
    starts = np.concatenate([[0], np.cumsum([len(dataset) for dataset in datasets])])
    items = [item for pack in packs for item in pack]
    arrays = {"pack_offsets": np.concatenate([[0], np.cumsum([len(pack) for pack in packs])]).astype(np.uint32),
              "samples": np.array([starts[d] + s for d, s, _ in items], dtype=np.uint32),
              "views": np.array([v for _, _, v in items], dtype=np.uint8)}
    return PackIndex(config, arrays, {}, starts)


def segment_costs(geometry, sample_lens):
    """A pack's forward FLOPs written out: linear work per token plus attention per n² of each sample."""
    return sum(geometry.linear_flops_per_token * n + geometry.attention_flops_per_square_token * n * n
               for n in sample_lens)


@st.composite
def packs_of(draw, datasets):
    """1-4 packs of 1-5 items, each a random view of a random sample of a random dataset."""
    packs = []
    for _ in range(draw(st.integers(1, 4))):
        pack = []
        for _ in range(draw(st.integers(1, 5))):
            number = draw(st.integers(0, len(datasets) - 1))
            sample = draw(st.integers(0, len(datasets[number]) - 1))
            pack.append((number, sample, draw(st.integers(0, datasets[number][sample].num_views - 1))))
        packs.append(pack)
    return packs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_cost_after_dropout_is_the_cost_of_the_pack_the_builder_writes(groups, data):
    probabilities = st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.9, 1.0]) | st.floats(0, 1)
    dropout = {kind: data.draw(probabilities, label=kind) for kind in ("text", "vit", "vae")}
    config = DataConfig.from_dict({"groups": groups, "geometry": GEOMETRY, "packing": PACKING, "dropout": dropout,
                                   "seed": data.draw(st.integers(0, 2**64), label="seed")})
    datasets = [MMIDXDataset(prefix) for group in config.groups for prefix in group.datasets]
    packs = data.draw(packs_of(datasets), label="packs")
    geometry = data.draw(st.sampled_from([LLMGeometry(), QWEN2_1_5B]), label="geometry")
    index = index_of(config, packs)
    costs = PackCosts(index, geometry)
    builder = PackBuilder(config, decode_images="device")  # sizes need no pixels
    offsets, tokens = costs.sample_tokens(0, len(packs))
    for k in range(len(packs)):
        batch = builder.build(k, index.items(k))
        assert [sum(splits) for splits in batch.split_lens] == batch.sample_lens  # the builder's own consistency
        assert tokens[offsets[k]:offsets[k + 1]].tolist() == batch.sample_lens
        assert costs[k:k + 1].tolist() == [segment_costs(geometry, batch.sample_lens)]
    assert np.array_equal(costs[:], np.concatenate([costs[k:k + 1] for k in range(len(packs))]))  # any range alike


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """The small t2i + vlm stream with CFG dropout 0.3 (about 30 packs) and its pack index."""
    path = write_data_config(tmp_path_factory.mktemp("dropout-stream"))
    config = DataConfig.from_yaml(path)
    return config, build_pack_index(config, num_samples=120, progress=False)


def built_costs(config, index):
    builder = PackBuilder(config, decode_images="device")
    return np.array([segment_costs(LLMGeometry(), builder.build(k, index.items(k)).sample_lens)
                     for k in range(len(index))])


def test_dropout_moves_the_costs_away_from_the_index_sizes_and_the_deal_follows_the_built_packs(stream):
    config, index = stream
    built = built_costs(config, index)
    assert pack_index_costs(index).tolist() == built.tolist() == PackCosts(index)[:].tolist()
    sizes = {}  # every element kept: the pack index's own estimate
    for g, group in enumerate(config.groups):
        for d, prefix in enumerate(group.datasets):
            sizes[g, d] = view_token_counts(MMIDXDataset(prefix), group, config.geometry)
    indexed = np.array([segment_costs(LLMGeometry(), [sizes[i.group, i.dataset][1][sizes[i.group, i.dataset][0][
        i.sample] + i.view] for i in index.items(k)]) for k in range(len(index))])
    assert (built < indexed).sum() >= len(index) // 2 and (built <= indexed).all()  # what dropout takes out
    world, per_rank = 2, 4
    g = world * per_rank
    shares = [GlobalBatchSampler(len(index), global_batch_size=g, rank=r, world_size=world,
                                 pack_costs=PackCosts(index)) for r in range(world)]
    moved = 0
    for b in range(len(index) // g):
        ranked = sorted(range(b * g, (b + 1) * g), key=lambda k: (-built[k], k))  # the built packs, dearest first
        steps = [[shares[r].pack_of_step(b * per_rank + j) for r in range(world)] for j in range(per_rank)]
        assert [pack for step in steps for pack in step] == ranked
        by_index = sorted(range(b * g, (b + 1) * g), key=lambda k: (-indexed[k], k))
        moved += by_index != ranked
    assert moved  # the index's sizes would have dealt some of these batches otherwise


def test_the_deal_is_the_same_on_every_rank_at_every_worker_count_and_in_a_pickled_copy(stream):
    config, index = stream
    costs = PackCosts(index)
    copy = pickle.loads(pickle.dumps(costs))  # what a spawned worker holds
    assert copy[:].tolist() == costs[:].tolist() and copy[3:11].tolist() == costs[3:11].tolist()
    handed = {}
    for workers in (0, 2):
        for rank in range(2):
            loader = PackLoader(PackDataset(index, PackBuilder(config)), global_batch_size=8, rank=rank,
                                world_size=2, num_workers=workers, pack_costs=PackCosts(index))
            handed[workers, rank] = [batch.packed_text_ids.tolist() for batch in loader]
            dealt = list(GlobalBatchSampler(len(index), global_batch_size=8, rank=rank, world_size=2,
                                            pack_costs=costs[:]))
            builder = PackBuilder(config)
            assert handed[workers, rank] == [builder.build(k, index.items(k)).packed_text_ids.tolist() for k in dealt]
    assert handed[0, 0] == handed[2, 0] and handed[0, 1] == handed[2, 1]


class PackNumbers:
    """A PackBuilder stand-in whose "batch" of pack k is k: which packs a loader hands out, without building them."""

    datasets = ()

    def build(self, pack, items):
        return pack


def test_a_state_saved_inside_a_global_batch_resumes_only_under_the_dropout_that_dealt_it(stream):
    config, index = stream
    world, g = 2, 8
    per_rank = g // world
    dropped = GlobalBatchSampler(len(index), global_batch_size=g, world_size=world, pack_costs=PackCosts(index))
    kept_config = replace(config, dropout=DropoutConfig(text=0.0, vit=0.0, vae=0.0))
    kept = GlobalBatchSampler(len(index), global_batch_size=g, world_size=world,
                              pack_costs=PackCosts(index, config=kept_config))
    # the micro-steps after which the two deals have handed out different packs of their global batch
    steps = [b * per_rank + j for b in range(len(index) // g) for j in range(1, per_rank)
             if sorted(dropped.deal(b)[:j * world]) != sorted(kept.deal(b)[:j * world])]
    assert steps, "dropout changes no deal: the deal does not see it"
    step = steps[0]

    def loader(rank, dropout_config):
        return PackLoader(PackDataset(index, PackNumbers()), global_batch_size=g, rank=rank, world_size=world,
                          pack_costs=PackCosts(index, config=dropout_config))

    whole = [list(loader(rank, config)) for rank in range(world)]
    saved = loader(0, config)
    assert list(zip(range(step), saved, strict=False)) == list(enumerate(whole[0][:step]))
    state = saved.state_dict()
    assert state["batch_consumed"] is not None
    for rank in range(world):  # the same dropout deals the same: each rank goes on as if never stopped
        resumed = loader(rank, config)
        resumed.load_state_dict(state)
        assert list(resumed) == whole[rank][step:]
    other = loader(0, kept_config)  # another dropout prices another deal: refused inside the batch
    with pytest.raises(LoaderStateError, match="deals to other micro-steps"):
        other.load_state_dict(state)


def test_costs_refuse_what_they_cannot_price(stream, groups):
    config, index = stream
    costs = PackCosts(index)
    with pytest.raises(TypeError, match="ranges of packs"):
        costs[3]
    with pytest.raises(ValueError, match="contiguous"):
        costs[0:8:2]
    with pytest.raises(IndexError, match="out of range"):
        costs.sample_tokens(0, len(index) + 1)
    other = DataConfig.from_dict({"groups": groups, "geometry": GEOMETRY, "packing": PACKING})
    with pytest.raises(ValueError, match="price an index with its own config"):
        PackCosts(index, config=other)
    corrupt = index_of(config, [[(0, 0, 0)]])
    corrupt.arrays["views"] = np.array([9], dtype=np.uint8)  # a view the sample does not hold
    with pytest.raises(fmt.FormatError, match="views"):
        PackCosts(corrupt)[:]
    corrupt.arrays["samples"] = np.array([10**6], dtype=np.uint32)
    with pytest.raises(fmt.FormatError, match="samples its datasets do not hold"):
        PackCosts(corrupt)[:]
    falling = index_of(config, [[(0, 0, 0), (0, 1, 0)], [(0, 2, 0)]])
    falling.arrays["pack_offsets"] = np.array([0, 3, 2], dtype=np.uint32)  # pack 0 past the samples, pack 1 back
    with pytest.raises(fmt.FormatError, match="pack_offsets do not rise within the index's samples; delete the cache "
                                              "entry to rebuild it"):
        PackCosts(falling)[:]
