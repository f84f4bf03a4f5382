"""torchdata's StatefulDataLoader over mmidx packs: exact resume with and without workers, across a change of
worker count (PackSampler.resume_from) and of world size, and the DCP Stateful protocol."""

import subprocess
import sys
from pathlib import Path

import pytest
from support.packs import assert_same_batches, pack_dataset, position, take, write_data_config
from torch.distributed.checkpoint.stateful import Stateful
from torchdata.stateful_dataloader import StatefulDataLoader

from mmidx import PackSampler
from mmidx.train.loader import PackLoader
from mmidx.train.state import LoaderStateError

GLOBAL_BATCH = 2
pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")  # torchdata 0.11 on torch 2.13


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return pack_dataset(write_data_config(tmp_path_factory.mktemp("sampler")))


@pytest.fixture(scope="module")
def stream(dataset):
    """The uninterrupted run without workers: every batch of the stream, in order."""
    return list(loader_of(dataset, 0))


def loader_of(dataset, num_workers, *, rank=0, world_size=1, sampler=None, snapshot_every_n_steps=1):
    sampler = sampler or PackSampler(dataset, global_batch_size=GLOBAL_BATCH, rank=rank, world_size=world_size)
    extra = {"prefetch_factor": 2} if num_workers else {}
    return StatefulDataLoader(dataset, sampler=sampler, batch_size=None, num_workers=num_workers,
                              snapshot_every_n_steps=snapshot_every_n_steps, **extra)


def test_the_comparison_tells_neighbouring_packs_apart(dataset):
    with pytest.raises(AssertionError):
        assert_same_batches([dataset[1]], [dataset[0]])
    with pytest.raises(AssertionError):
        assert_same_batches([dataset[0]], [dataset[0], dataset[1]])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_restored_loader_hands_out_batch_n_plus_1_next(dataset, stream, num_workers):
    uninterrupted = list(loader_of(dataset, num_workers)) if num_workers else stream
    assert len(uninterrupted) == (len(dataset) // GLOBAL_BATCH) * GLOBAL_BATCH
    loader = loader_of(dataset, num_workers)
    first = take(loader, 5)  # 2 workers × prefetch_factor 2: packs 6 to 9 are drawn, some built, when it saves
    state = loader.state_dict()
    resumed = loader_of(dataset, num_workers)
    resumed.load_state_dict(state)
    assert_same_batches(first + list(resumed), uninterrupted)


@pytest.mark.parametrize(("saved_with", "resumed_with", "snapshot_every_n_steps"), [(2, 0, 1), (1, 2, 3)])
def test_resume_from_carries_the_state_to_another_worker_count(dataset, stream, saved_with, resumed_with,
                                                               snapshot_every_n_steps):
    loader = loader_of(dataset, saved_with, snapshot_every_n_steps=snapshot_every_n_steps)
    first = take(loader, 7)  # every 3 steps: torchdata's state is its snapshot after batch 6, and one more step
    sampler = PackSampler(dataset, global_batch_size=GLOBAL_BATCH)
    sampler.resume_from(loader.state_dict())
    rest = list(loader_of(dataset, resumed_with, sampler=sampler))
    assert_same_batches(first + rest, stream, drop_worker_ids=True)


def test_a_state_saved_at_an_optimizer_step_resumes_at_another_world_size(dataset, stream):
    single = stream
    ranks = [loader_of(dataset, 0, rank=rank, world_size=2) for rank in range(2)]
    first = [take(loader, 3) for loader in ranks]  # 3 global batches of 2 packs: rank 0 has packs 0, 2, 4
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()  # one global integer, the same on every rank
    assert_same_batches([batch for step in zip(*first, strict=True) for batch in step], single[:6])
    sampler = PackSampler(dataset, global_batch_size=GLOBAL_BATCH)
    sampler.resume_from(state)
    assert_same_batches(list(loader_of(dataset, 2, sampler=sampler)), single[6:], drop_worker_ids=True)


def test_a_state_saved_inside_a_global_batch_resumes_only_at_its_world_size(dataset):
    sampler = PackSampler(dataset, global_batch_size=4, world_size=2)
    take(sampler, 1)  # rank 0 drew pack 0 of packs 0-3; rank 1 drew pack 2
    state = sampler.state_dict()
    assert position(state) == {"packs_consumed": 2, "world_size": 2, "global_batch_size": 4}
    with pytest.raises(ValueError, match="resume it at world size 2 with global_batch_size 4, or from a checkpoint "
                                         "taken at an optimizer"):
        PackSampler(dataset, global_batch_size=4).load_state_dict(state)
    same_world = PackSampler(dataset, global_batch_size=4, rank=1, world_size=2)
    same_world.load_state_dict(state)
    assert list(same_world)[:3] == [3, 6, 7]  # the rest of its share of packs 0-3, then of 4-7


def test_a_loader_state_without_a_pack_sampler_is_refused_with_the_way_out(dataset):
    plain = StatefulDataLoader(dataset, batch_size=None)
    take(plain, 2)
    with pytest.raises(ValueError, match="start this one afresh"):
        PackSampler(dataset).resume_from(plain.state_dict())
    with pytest.raises(ValueError, match="not the sampler's"):
        PackSampler(dataset).resume_from({"packs_consumed": 2, "world_size": 1})


def test_a_state_of_another_seed_is_refused_by_the_sampler_torchdata_and_resume_from(dataset):
    folder = Path(dataset.packs.config.groups[0].datasets[0]).parent
    other = folder / "other-seed.yaml"
    other.write_text((folder / "data.yaml").read_text().replace("seed: 5", "seed: 6"))  # the same datasets
    other = pack_dataset(other)
    loader = loader_of(dataset, 2)
    take(loader, 3)
    saved = loader.state_dict()
    resumed = loader_of(other, 2)
    resumed.load_state_dict(saved)  # torchdata hands the sampler its state when it starts iterating
    with pytest.raises(LoaderStateError, match=r"the seed \(5 → 6\) differs"):
        next(iter(resumed))
    with pytest.raises(LoaderStateError, match=r"the seed \(5 → 6\) differs"):
        PackSampler(other, global_batch_size=GLOBAL_BATCH).resume_from(saved)
    anyway = PackSampler(other, global_batch_size=GLOBAL_BATCH)
    with pytest.warns(UserWarning, match="continuing this stream at pack 3 as strict=False asks"):
        anyway.resume_from(saved, strict=False)
    assert next(iter(anyway)) == 3


def test_the_loader_and_the_sampler_are_dcp_stateful(dataset):
    assert isinstance(PackLoader(dataset, global_batch_size=1), Stateful)
    assert isinstance(PackSampler(dataset), Stateful)


def test_import_mmidx_imports_no_training_framework_and_a_missing_one_is_one_line():
    code = """
import sys
import mmidx
mmidx.PackSampler, mmidx.PackLoader
print([m for m in ("torchdata", "lightning", "accelerate", "torchtitan") if m in sys.modules])
for module, package in [("mmidx.train.lightning", "lightning"), ("mmidx.train.torchtitan", "torchtitan")]:
    sys.modules[package] = None  # as if not installed
    try:
        __import__(module)
    except ImportError as error:
        print(error)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.splitlines() == [
        "[]", 'mmidx.train.lightning needs lightning: pip install "mmidx[lightning]"',
        'mmidx.train.torchtitan needs torchtitan: pip install "mmidx[torchtitan]"']
