"""A conditioning clip whose first or last frame is dropped by CFG dropout keeps consistent splits.

BAGEL's ``_add_video(need_vae=True, enable_cfg=True)`` plans clean frames with ``split_start`` on
the first and ``split_end`` on the last; dropping either makes BAGEL write ``split_lens`` and
``attn_modes`` of different lengths. mmidx opens the split on the first kept frame and closes it
on the last kept one; packs where both ends are kept stay equal to the naive reference of the spec
(support/bagel_reference.py, written from the same spec as mmidx, not BAGEL itself).
"""

import numpy as np
import pytest
import torch
from support.packing import GEOMETRY, SPECIAL, VAE, _encoded, assert_same, reference_batch

from mmidx.config import DataConfig
from mmidx.index.dropout import sample_randomness
from mmidx.index.pack_index import PackItem
from mmidx.ingest.writer import DatasetBuilder
from mmidx.pack.builder import PackBuilder
from mmidx.sources.elements import Element

FRAMES = 4
DROPOUT = {"text": 0.0, "vit": 0.0, "vae": 0.5}


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    rng = np.random.default_rng(3)
    with DatasetBuilder(folder / "video", vocab_size=1000, special_tokens=SPECIAL) as builder:
        clip = [Element("vae_image", j, enable_cfg=True, split_start=j == 0, split_end=j == FRAMES - 1,
                        frame_delta=j + 1 if j < FRAMES - 1 else None) for j in range(FRAMES)]
        plan = [Element("text", 0), *clip, Element("vae_image", FRAMES, loss=True)]
        builder.add_sample([rng.integers(10, 500, 5).tolist()], [_encoded(rng, "RGB") for _ in range(FRAMES + 1)],
                           [plan])
        builder.finalize()
    return {"video": {"datasets": [str(folder / "video")], "image_transform_args": VAE}}


def kept_frames(config, pack):
    """Which clip frames survive CFG dropout in pack ``pack`` (the sample is the pack's only one)."""
    uniforms, _ = sample_randomness(config.seed, pack, 0, FRAMES + 2)
    return [j for j in range(FRAMES) if uniforms[1 + j] >= config.dropout.vae]


@pytest.mark.parametrize("use_flex", [True, False])
def test_dropped_first_or_last_frames_keep_splits_consistent(groups, use_flex):
    config = DataConfig.from_dict({"groups": groups, "dropout": DROPOUT, "geometry": GEOMETRY,
                                   "packing": {"max_num_tokens": 8192, "expected_num_tokens": 4096,
                                               "max_num_tokens_per_sample": 4096}})
    builder = PackBuilder(config, use_flex=use_flex)
    cases = set()
    for pack in range(20):
        kept = kept_frames(config, pack)
        batch = builder.build(pack, [PackItem(0, 0, 0, 0)])
        data = batch.to_dict()
        frame_lens = [int(np.prod(shape)) + 2 for shape in data["patchified_vae_latent_shapes"]]
        # text split, then the clip's one split of its kept frames (if any), then the noised target
        expected = [7] + ([sum(frame_lens[:len(kept)])] if kept else []) + [frame_lens[-1]]
        assert batch.split_lens == [expected]
        assert batch.attn_modes == [["causal"] + (["full"] if kept else []) + ["noise"]]
        assert batch.sample_lens == [len(data["packed_position_ids"])] == [sum(expected)]
        if use_flex:
            assert sum(data["split_lens"]) == sum(data["sample_lens"]) == batch.max_num_tokens
        else:
            (mask,) = data["nested_attention_masks"]
            assert mask.shape == (sum(expected), sum(expected))
            assert not torch.isinf(mask).all(dim=1).any()  # every real token attends somewhere
        if kept and kept[0] == 0 and kept[-1] == FRAMES - 1:
            assert_same(data, reference_batch(config, [PackItem(0, 0, 0, 0)], pack, use_flex, groups))
        cases.add((bool(kept) and kept[0] > 0, bool(kept) and kept[-1] < FRAMES - 1, not kept))
    assert {(True, False, False), (False, True, False), (True, True, False), (False, False, True),
            (False, False, False)} <= cases


def test_a_noised_image_in_the_split_its_caption_opens_takes_its_own_draw_as_timestep(tmp_path):
    """The split opens on the text; the noised image after it in the same split draws its timestep (the normal
    of its element, as every noised image whose split has drawn none yet)."""
    rng = np.random.default_rng(5)
    with DatasetBuilder(tmp_path / "caption", vocab_size=1000, special_tokens=SPECIAL) as builder:
        plan = [Element("text", 0, split_end=False), Element("vae_image", 0, loss=True, split_start=False)]
        builder.add_sample([rng.integers(10, 500, 5).tolist()], [_encoded(rng, "RGB")], [plan])
        builder.finalize()
    groups = {"caption": {"datasets": [str(tmp_path / "caption")], "image_transform_args": VAE}}
    config = DataConfig.from_dict({"groups": groups, "geometry": GEOMETRY, "seed": 11,
                                   "packing": {"max_num_tokens": 8192, "expected_num_tokens": 4096,
                                               "max_num_tokens_per_sample": 4096}})
    for pack in range(3):
        batch = PackBuilder(config).build(pack, [PackItem(0, 0, 0, 0)])
        _, normals = sample_randomness(config.seed, pack, 0, len(plan))
        assert batch.split_lens == [[batch.sequence_length]]  # one split: the caption and its image
        timesteps = batch.to_dict()["packed_timesteps"]
        assert len(timesteps) > 0 and torch.equal(timesteps, torch.full_like(timesteps, float(np.float32(normals[1]))))
