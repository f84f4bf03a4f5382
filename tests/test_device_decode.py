"""Images decoded where the batch moves (decode_images="device"): same batch, pixels within resize tolerance."""

import pickle

import pytest
import torch
from support.packing import build_groups, config_of

from mmidx.errors import MMIDXError
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


H100 = "NVIDIA H100 80GB HBM3"
MEASURED = "the GPU suite at abc1234: 134 of 200 decodes with the caller's stream busy were inexact"


def test_decoding_on_a_gpu_measured_inexact_is_refused_with_the_measured_reason(monkeypatch):
    from mmidx.images import device

    monkeypatch.setattr(device, "INEXACT_GPUS", {H100: MEASURED})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None: H100)
    monkeypatch.delenv("MMIDX_DEVICE_DECODE", raising=False)
    jpeg = b"\xff\xd8\xff\xe0" + bytes(100)
    with pytest.raises(device.DeviceDecodeError) as refused:
        device.decode_jpeg_batch([jpeg], "cuda")
    message = str(refused.value)
    assert H100 in message and MEASURED in message and "decode_images='loader'" in message
    assert "MMIDX_DEVICE_DECODE=allow" in message and "\n" not in message


def test_the_refusal_names_only_listed_gpus_and_lifts_with_the_allow_variable(monkeypatch):
    from mmidx.images.device import check_device_decode

    monkeypatch.setattr("mmidx.images.device.INEXACT_GPUS", {H100: MEASURED})
    monkeypatch.delenv("MMIDX_DEVICE_DECODE", raising=False)
    check_device_decode("NVIDIA A100-SXM4-80GB")  # not listed: decoded there
    monkeypatch.setenv("MMIDX_DEVICE_DECODE", "yes")
    with pytest.raises(MMIDXError, match="is refused"):
        check_device_decode(H100)  # only "allow" lifts it
    monkeypatch.setenv("MMIDX_DEVICE_DECODE", "allow")
    check_device_decode(H100)
