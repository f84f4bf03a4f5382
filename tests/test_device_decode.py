"""Images decoded where the batch moves (decode_images="device"): same batch, pixels within resize tolerance."""

import pickle

import pytest
import torch
from support.packing import build_groups, config_of

from mmidx.index.pack_index import build_pack_index
from mmidx.pack.builder import PackBuilder
from mmidx.train.loader import PackDataset, PackLoader

IMAGE_KEYS = ("padded_images", "packed_vit_tokens")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    groups = build_groups(tmp_path_factory.mktemp("device"), photo=True)
    config = config_of(groups, dropout={"text": 0.2, "vit": 0.2, "vae": 0.2})
    return config, build_pack_index(config, num_samples=60)


def test_deferred_batches_equal_loader_batches_within_resize_tolerance(setup):
    config, index = setup
    exact, deferred = PackBuilder(config), PackBuilder(config, decode_images="device")
    for k in range(len(index)):
        expected = exact.build(k, index.items(k)).to_dict()
        got = deferred.build(k, index.items(k)).to("cpu").to_dict()
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            if key in IMAGE_KEYS:
                assert got[key].shape == value.shape and got[key].dtype == value.dtype
                # on photo-like images torch's antialiased bicubic (two passes, as PIL) is within 2 levels
                # of PIL's; on pure noise it can differ by up to ~15 where the kernels' taps differ
                assert (got[key] - value).abs().max() <= 2 / 127.5 + 1e-6, key
            elif isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value), key
            elif key != "nested_attention_masks":
                assert got[key] == value, key


def test_deferred_batches_ship_encoded_bytes_not_pixels(setup):
    config, index = setup
    k = max(range(len(index)), key=lambda k: len(index.items(k)))
    exact = pickle.dumps(PackBuilder(config).build(k, index.items(k)))
    deferred_batch = PackBuilder(config, decode_images="device").build(k, index.items(k))
    assert all(key not in deferred_batch.tensors for key in IMAGE_KEYS)
    assert len(pickle.dumps(deferred_batch)) * 3 < len(exact)


def test_the_loader_moves_deferred_batches_and_decodes_them_there(setup):
    config, index = setup
    dataset = PackDataset(index, PackBuilder(config, decode_images="device"))
    batch = next(iter(PackLoader(dataset, global_batch_size=1, num_workers=1, device="cpu")))
    assert batch.deferred is None and any(key in batch.tensors for key in IMAGE_KEYS)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the nvJPEG decode and the CUDA resize run only there (the CPU tests "
                           "above decode with PIL and resize with torch on the CPU)")
def test_deferred_images_decode_on_the_gpu(setup):
    config, index = setup
    batch = PackBuilder(config, decode_images="device").build(0, index.items(0)).to("cuda")
    assert all(tensor.is_cuda for key, tensor in batch.tensors.items() if key in IMAGE_KEYS)


def test_an_unknown_decode_mode_is_refused(setup):
    with pytest.raises(ValueError, match="decode_images"):
        PackBuilder(setup[0], decode_images="gpu")
