"""The torch loader: same batches for any worker count, world size, and after resume."""

import pytest
import torch
from support.packing import build_groups, config_of
from support.packs import position

from mmidx.index.pack_index import build_pack_index
from mmidx.pack.builder import PackBuilder
from mmidx.train.loader import PackDataset, PackLoader
from mmidx.train.sampler import PackSampler
from mmidx.train.shares import GlobalBatchError, GlobalBatchSampler


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    groups = build_groups(tmp_path_factory.mktemp("loader"))
    config = config_of(groups, dropout={"text": 0.3, "vit": 0.3, "vae": 0.3})
    packs = PackDataset(build_pack_index(config, num_samples=300), PackBuilder(config))
    assert len(packs) >= 12
    return packs


def fingerprint(batch):
    return (batch.packed_position_ids.sum().item(), batch.packed_text_ids.tolist(),
            batch.packed_timesteps.nan_to_num(neginf=-1).sum().item() if "packed_timesteps" in batch.tensors else 0,
            [d["sample"] for d in batch.batch_data_indexes])


def test_same_batches_for_0_1_and_2_workers(dataset):
    runs = [[fingerprint(b) for b in PackLoader(dataset, global_batch_size=2, num_workers=n)] for n in (0, 1, 2)]
    assert len(runs[0]) == (len(dataset) // 2) * 2
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_share_each_global_batch_whatever_the_world_size(world_size):
    single = list(GlobalBatchSampler(103, global_batch_size=8))
    ranks = [list(GlobalBatchSampler(103, global_batch_size=8, rank=r, world_size=world_size))
             for r in range(world_size)]
    for step in range(103 // 8):
        share = 8 // world_size
        union = sorted(p for r in ranks for p in r[step * share:(step + 1) * share])
        assert union == sorted(single[step * 8:(step + 1) * 8])


def test_resume_at_an_arbitrary_pack_continues_exactly(dataset):
    full = [fingerprint(b) for b in PackLoader(dataset, global_batch_size=2)]
    loader = PackLoader(dataset, global_batch_size=2, num_workers=2)
    taken, workers = [], set()
    for batch in loader:
        taken.append(fingerprint(batch))
        workers |= {entry["worker_id"] for entry in batch.batch_data_indexes}
        if len(taken) == 3:
            break
    assert workers == {0, 1}  # each sample names the DataLoader worker that built its pack, as BAGEL's do
    state = loader.state_dict()
    assert position(state) == {"packs_consumed": 3, "world_size": 1, "global_batch_size": 2}
    assert state["batch_consumed"] is not None  # inside a global batch: which of its packs were consumed
    resumed = PackLoader(dataset, global_batch_size=2)
    resumed.load_state_dict(state)
    assert taken + [fingerprint(b) for b in resumed] == full


def test_pinned_batches_move_to_the_device_and_build_masks_there(dataset):
    batch = next(iter(PackLoader(dataset, global_batch_size=1, pin_memory=torch.cuda.is_available(), device="cpu")))
    data = batch.to_dict()
    assert data["packed_text_ids"].device.type == "cpu"
    assert data["split_lens"][-1] == batch.max_num_tokens - batch.sequence_length


def test_a_world_size_that_cannot_share_the_global_batch_is_refused_at_construction(dataset):
    with pytest.raises(GlobalBatchError, match="multiple of the world size"):
        GlobalBatchSampler(10, global_batch_size=6, world_size=4)
    for make in (PackLoader, PackSampler):  # not at iter() or len()
        with pytest.raises(GlobalBatchError, match=r"^global_batch_size 8 must be a multiple of the world size 3, so "
                                                   r"every rank gets the same share$"):
            make(dataset, global_batch_size=8, rank=0, world_size=3)
    with pytest.raises(GlobalBatchError, match="rank 3 is not in a world of 3"):
        PackLoader(dataset, global_batch_size=6, rank=3, world_size=3)
    with pytest.raises(GlobalBatchError, match="holds 2 costs for"):
        PackLoader(dataset, global_batch_size=2, pack_costs=[1.0, 2.0])
