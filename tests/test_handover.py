"""Batches built in DataLoader workers reach the trainer process in the workers' shared memory (mmidx.pack.shared):
the same bytes as without workers, no copy on the way, and never overwritten while the trainer holds them."""

import gc
import os
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from support.packing import build_groups, config_of

import mmidx.pack.shared
from mmidx.index.pack_index import build_pack_index
from mmidx.pack.buffers import mask_buffer
from mmidx.pack.builder import PackBuilder
from mmidx.train.loader import PackDataset, PackLoader


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    groups = build_groups(tmp_path_factory.mktemp("handover"), photo=True)
    config = config_of(groups, dropout={"text": 0.3, "vit": 0.3, "vae": 0.3})
    index = build_pack_index(config, num_samples=200)
    assert len(index) >= 12
    return config, index


def tensors_of(batch):
    """Every tensor a batch carries, by name: its keys and, deferred, its encoded images."""
    found = {key: value for key, value in batch.tensors.items() if isinstance(value, torch.Tensor)}
    if batch.deferred is not None:
        found.update({f"encoded {n}": data for n, data in enumerate(batch.deferred.encoded)})
    return found


def mapping_of(address):
    """The line of /proc/self/maps whose range holds ``address``: (permissions, inode, path)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            if low <= address < high:
                return fields[1], fields[4], fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is in no mapping")


def assert_same_batch(got, expected):
    assert sorted(tensors_of(got)) == sorted(tensors_of(expected))
    for key, tensor in tensors_of(expected).items():
        assert got_equal(tensors_of(got)[key], tensor), key
    assert {key: value for key, value in got.tensors.items() if not isinstance(value, torch.Tensor)} == \
        {key: value for key, value in expected.tensors.items() if not isinstance(value, torch.Tensor)}
    assert (got.split_lens, got.attn_modes, got.sample_lens) == \
        (expected.split_lens, expected.attn_modes, expected.sample_lens)
    strip = [[{k: v for k, v in entry.items() if k != "worker_id"} for entry in b.batch_data_indexes]
             for b in (got, expected)]
    assert strip[0] == strip[1]


def got_equal(got, expected):
    return got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)


@pytest.mark.parametrize("decode", ["loader", "device"])
def test_batches_from_workers_hold_the_bytes_built_without_workers(setup, decode):
    config, index = setup
    dataset = PackDataset(index, PackBuilder(config, decode_images=decode))
    without = list(PackLoader(dataset, global_batch_size=2))
    with_workers = list(PackLoader(dataset, global_batch_size=2, num_workers=2))
    assert len(with_workers) == len(without) >= 12
    for got, expected in zip(with_workers, without, strict=True):
        assert_same_batch(got, expected)


@pytest.mark.parametrize("decode", ["loader", "device"])
def test_a_batch_from_a_worker_arrives_in_the_workers_shared_memory_not_a_copy(setup, decode):
    config, index = setup
    dataset = PackDataset(index, PackBuilder(config, decode_images=decode))
    batch = next(iter(PackLoader(dataset, global_batch_size=1, num_workers=1)))
    tensors = tensors_of(batch)
    assert len(tensors) >= 8
    for key, tensor in tensors.items():
        # a shared mapping of the worker's memfd; torch's copy would be a file of its own, /dev/shm/torch_*
        permissions, _, path = mapping_of(tensor.data_ptr())
        assert permissions.endswith("s") and path.startswith("/memfd:mmidx-batch"), (key, permissions, path)
    assert len({mapping_of(tensor.data_ptr())[1] for tensor in tensors.values()}) == 1  # one segment a pack


def test_batches_held_by_the_trainer_are_never_overwritten_by_later_ones(setup):
    config, index = setup
    dataset = PackDataset(index, PackBuilder(config))
    expected = list(PackLoader(dataset, global_batch_size=1))
    kept, copies, segments = {}, {}, []
    for k, batch in enumerate(PackLoader(dataset, global_batch_size=1, num_workers=1)):
        segments.append(mapping_of(batch.packed_text_ids.data_ptr())[1])
        if k % 3 == 0:  # every third batch held to the end, the others let go at once
            kept[k] = batch
            copies[k] = {key: tensor.clone() for key, tensor in tensors_of(batch).items()}
    assert len(set(segments)) < len(segments) - len(kept)  # the worker reused the segments let go
    for k, batch in kept.items():
        assert_same_batch(batch, expected[k])
        assert all(torch.equal(tensors_of(batch)[key], copy) for key, copy in copies[k].items())


def test_batches_from_torchdatas_stateful_workers_arrive_in_shared_memory_too(setup):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from mmidx.train.sampler import PackSampler

    config, index = setup
    dataset = PackDataset(index, PackBuilder(config))
    loader = StatefulDataLoader(dataset, sampler=PackSampler(dataset, global_batch_size=1), batch_size=None,
                                num_workers=2)
    for k, batch in zip(range(4), loader, strict=False):
        assert_same_batch(batch, PackBuilder(config).build(k, index.items(k)))
        assert mapping_of(batch.padded_images.data_ptr())[2].startswith("/memfd:mmidx-batch")


class MaskPacks(torch.utils.data.Dataset):
    """Dense masks of at least 32 MiB, as a dataset building them in the worker would: from the worker's reused
    mask buffers (mmidx.pack.buffers.mask_buffer), item k filled with k."""

    def __len__(self):
        return 8

    def __getitem__(self, k):
        return torch.from_numpy(mask_buffer(33 << 20)).fill_(k)


def test_masks_built_in_a_worker_from_its_reused_buffers_are_never_overwritten_after_the_hand_over():
    loader = torch.utils.data.DataLoader(MaskPacks(), batch_size=None, num_workers=1)
    kept = list(loader)  # more alive at once than the worker's two mask buffers
    assert [torch.all(masks == k).item() for k, masks in enumerate(kept)] == [True] * 8


@pytest.fixture
def as_worker(monkeypatch):
    """This process taken for a DataLoader worker, with a pool of its own (restored afterwards)."""
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: types.SimpleNamespace(id=0))
    monkeypatch.setattr(mmidx.pack.shared, "_POOL", None)
    return mmidx.pack.shared.worker_pool()


def segment_of(pool, tensor):
    return next(number for number, segment in enumerate(pool.segments) if segment.holds(tensor))


def test_a_segment_is_written_again_only_once_every_hand_over_of_it_is_released(setup, as_worker):
    config, index = setup
    builder, pool = PackBuilder(config), as_worker
    built = builder.build(0, index.items(0))
    first = segment_of(pool, built.packed_text_ids)
    message = ForkingPickler.dumps(built)
    received = [ForkingPickler.loads(message), ForkingPickler.loads(ForkingPickler.dumps(built))]  # handed twice
    del built
    assert segment_of(pool, builder.build(1, index.items(1)).packed_text_ids) != first  # both receipts alive
    held = received.pop().packed_position_ids  # one receipt let go but for one of its tensors
    gc.collect()
    assert segment_of(pool, builder.build(1, index.items(1)).packed_text_ids) != first
    received.clear()
    gc.collect()
    assert segment_of(pool, builder.build(1, index.items(1)).packed_text_ids) != first  # that tensor still holds it
    del held
    gc.collect()
    assert segment_of(pool, builder.build(1, index.items(1)).packed_text_ids) == first  # all released: reused


def test_a_process_forked_from_the_receiver_does_not_release_its_segments(setup, as_worker):
    config, index = setup
    builder, pool = PackBuilder(config), as_worker
    built = builder.build(0, index.items(0))
    first = segment_of(pool, built.packed_text_ids)
    received = ForkingPickler.loads(ForkingPickler.dumps(built))
    del built
    child = os.fork()
    if child == 0:  # drops its copy of the batch and ends
        del received
        gc.collect()
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    assert segment_of(pool, builder.build(1, index.items(1)).packed_text_ids) != first  # the receiver holds it
    expected = PackBuilder(config).build(0, index.items(0))
    assert torch.equal(received.packed_text_ids, expected.packed_text_ids)
    assert torch.equal(received.padded_images, expected.padded_images)


def test_a_batch_built_outside_a_worker_is_pickled_by_torch_as_before(setup):
    config, index = setup
    batch = PackBuilder(config).build(0, index.items(0))
    received = ForkingPickler.loads(ForkingPickler.dumps(batch))
    assert all(tensor.is_shared() for tensor in tensors_of(received).values())  # torch's own shared memory
    assert_same_batch(received, batch)
