"""Precached encodings: the encoder sees the pack's own pixels, packs carry the stored records, a
killed precache resumes byte-identically, and streams from other inputs are refused."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import encoders
from support.precache import SIZES, SPECIAL, VAE, _noise_png, make_datasets

from mmidx import format as fmt
from mmidx.config import DataConfig, DropoutConfig, GroupConfig
from mmidx.encodings.encode import Job
from mmidx.encodings.precache import precache_dataset
from mmidx.format import FormatError
from mmidx.images.transform import ImageTransform
from mmidx.index.pack_index import PackItem
from mmidx.ingest.writer import DatasetBuilder
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources.elements import Element

TESTS = Path(__file__).parent
VIT = ImageTransform(max_image_size=56, min_image_size=28, image_stride=14)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_datasets(tmp_path_factory.mktemp("precache"))


def _config(folder, **group):
    return DataConfig(groups=(GroupConfig("t2i", (str(folder / "t2i"),), image_transform=VAE, **group),
                              GroupConfig("edit", (str(folder / "edit"),), image_transform=VAE,
                                          vit_image_transform=VIT, **group)), seed=3)


def _precache(folder, name, job=None, **options):
    job = job or Job(name, "support.encoders:vae", dtype="fp32", batch_size=2)
    return [precache_dataset(str(folder / d), job, VAE, progress=False, **options) for d in ("t2i", "edit")]


def _packs(builder, folder):
    items = [PackItem(0, 0, s, 0) for s in range(len(SIZES))] + [PackItem(1, 0, s, 0) for s in range(4)]
    return [builder.build(k, items[k::3]) for k in range(3)]


def test_stored_latents_are_the_encoder_on_the_packs_own_pixels(data):
    _precache(data, "mean", Job("mean", "support.encoders:vae", store="mean", dtype="fp32", batch_size=2))
    pixel_builder = PackBuilder(_config(data), special_tokens=SPECIAL)
    latent_builder = PackBuilder(_config(data), special_tokens=SPECIAL, encodings={"vae": "mean"})
    model = encoders.vae()
    for pixels, latents in zip(_packs(pixel_builder, data), _packs(latent_builder, data), strict=True):
        assert "padded_images" not in latents.tensors and "padded_latent" in latents.tensors
        assert pixels.patchified_vae_latent_shapes == latents.patchified_vae_latent_shapes
        assert torch.equal(pixels.packed_vit_tokens, latents.packed_vit_tokens)  # ViT keeps pixels
        for slot, (h, w) in enumerate(pixels.patchified_vae_latent_shapes):
            image = pixels.padded_images[slot:slot + 1, :, :h * 16, :w * 16]
            with torch.no_grad():
                expected = model(image)[0][0]  # the encoder on the pack's own unpadded pixels
            got = latents.padded_latent[slot]
            torch.testing.assert_close(got[:, :2 * h, :2 * w], expected, rtol=1e-5, atol=1e-5)
            assert not got[:, 2 * h:].any() and not got[:, :, 2 * w:].any()  # BAGEL's padded layout
        for key, value in pixels.tensors.items():
            if key != "padded_images":
                assert str(latents.tensors[key]) == str(value), key


def test_records_round_trip_exactly_and_packs_carry_them(data, monkeypatch):
    metas = _precache(data, "bf", Job("bf", "support.encoders:vae_mean", dtype="bf16", batch_size=4))
    assert [meta["store"] for meta in metas] == ["tensor", "tensor"]
    builder = PackBuilder(_config(data), special_tokens=SPECIAL, encodings={"vae": "bf"})
    pack = builder.build(0, [PackItem(0, 0, 1, 0), PackItem(1, 0, 2, 0)])
    sample = MMIDXDataset(data / "edit")[2]
    stored = [MMIDXDataset(data / "t2i")[1].encoding("bf", 0), sample.encoding("bf", 0), sample.encoding("bf", 1, 2)]
    assert all(value.dtype == torch.bfloat16 for value in stored)
    for slot, value in enumerate(stored):
        h, w = value.shape[1:]
        assert torch.equal(pack.padded_latent[slot, :, :h, :w], value.float())
    with pytest.raises(FormatError, match="no record"):
        sample.encoding("bf", 1, 1)  # that image is used with img_num 2 only
    import mmidx.pack.pixels

    def no_decoding(data):
        raise AssertionError("an image was decoded")

    monkeypatch.setattr(mmidx.pack.pixels, "decode_rgb_pixels", no_decoding)
    t2i = builder.build(1, [PackItem(0, 0, s, 0) for s in range(len(SIZES))])  # VAE images only: none decoded
    assert len(t2i.padded_latent) == len(SIZES)
    no_dropout = PackBuilder(dataclasses.replace(_config(data), dropout=DropoutConfig(0, 0, 0)),
                             special_tokens=SPECIAL, encodings={"vae": "bf"})
    with pytest.raises(AssertionError, match="decoded"):
        no_dropout.build(1, [PackItem(1, 0, 0, 0)])  # an edit sample's ViT image keeps its pixels


def _reference_noise(seed, pack, slot, shape):
    """Normals of the noise module's docstring, written out here: Philox4x32-10 blocks (the function itself is
    checked against Random123's known answers) through a float64 Box-Muller in numpy."""
    from mmidx.encodings.noise import philox4x32

    count = int(np.prod(shape))
    block = torch.arange((count + 3) // 4)
    x = [v.numpy() for v in philox4x32([block, block * 0 + slot, block * 0 + pack, block * 0], (seed, 0))]
    normals = []
    for a, b in ((x[0], x[1]), (x[2], x[3])):
        radius = np.sqrt(-2 * np.log(((a >> 8) + 1) / 2**24))
        normals.append((radius * np.cos(2 * np.pi * (b >> 8) / 2**24), radius * np.sin(2 * np.pi * (b >> 8) / 2**24)))
    lanes = np.stack([normals[0][0], normals[0][1], normals[1][0], normals[1][1]], axis=1).reshape(-1)
    return torch.from_numpy(lanes[:count].reshape(shape)).float()


def test_philox_matches_random123s_known_answers():
    from mmidx.encodings.noise import philox4x32

    cases = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
             ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
             ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
              (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]
    for counter, key, expected in cases:
        assert tuple(int(v) for v in philox4x32([torch.tensor([c]) for c in counter], key)) == expected


def test_moments_ship_with_their_key_and_are_sampled_where_the_batch_moves(data):
    _precache(data, "mom", Job("mom", "support.encoders:vae", dtype="fp32", batch_size=3))
    builder = PackBuilder(_config(data), special_tokens=SPECIAL, encodings={"vae": "mom"})
    items = [PackItem(0, 0, 0, 0), PackItem(0, 0, 2, 0), PackItem(0, 0, 1, 0)]  # two images of one size
    shipped = builder.build(5, items)
    assert "padded_latent" not in shipped.tensors  # nothing sampled in the loader
    assert shipped.tensors["latent_noise_key"].tolist() == [3, 5]
    first, again, other = shipped.to("cpu"), builder.build(5, items).to("cpu"), builder.build(6, items).to("cpu")
    assert torch.equal(first.padded_latent, again.padded_latent)
    assert not torch.equal(first.padded_latent, other.padded_latent)
    assert "padded_latent_moments" not in first.to_dict() and "latent_noise_key" not in first.to_dict()
    dataset = MMIDXDataset(data / "t2i")
    for slot, sample in enumerate((0, 2, 1)):
        moments = dataset[sample].encoding("mom", 0)
        c, h, w = moments.shape[1:]
        expected = moments[0] + torch.exp(0.5 * moments[1]) * _reference_noise(3, 5, slot, (c, h, w))
        torch.testing.assert_close(first.padded_latent[slot, :, :h, :w], expected, rtol=1e-5, atol=1e-5)
        assert not first.padded_latent[slot, :, h:].any() and not first.padded_latent[slot, :, :, w:].any()
    assert not torch.equal(first.padded_latent[0, :, :2, :2], first.padded_latent[1, :, :2, :2])  # own noise


def test_moments_sampled_on_a_device_agree_with_the_cpu(data):
    """The same code on CUDA where there is one (on CPU in CI: ``device="cpu"``, through pin_memory too)."""
    _precache(data, "momd", Job("momd", "support.encoders:vae", batch_size=3))  # bf16 moments
    builder = PackBuilder(_config(data), special_tokens=SPECIAL, encodings={"vae": "momd"})
    items = [PackItem(0, 0, s, 0) for s in range(len(SIZES))]
    cpu = builder.build(2, items).to("cpu").padded_latent
    assert builder.build(2, items).tensors["padded_latent_moments"].dtype == torch.bfloat16
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        moved = builder.build(2, items)
        moved = moved.pin_memory() if device == "cuda" else moved
        torch.testing.assert_close(moved.to(device).padded_latent.cpu(), cpu, rtol=1e-5, atol=1e-5)


def test_vit_encodings_are_the_encoder_on_the_packs_own_vit_pixels_in_token_order(data):
    job = Job("vitenc", "support.encoders:vit", transform="vit", dtype="fp32", batch_size=2)
    precache_dataset(str(data / "edit"), job, VIT, progress=False)
    _precache(data, "mean2", Job("mean2", "support.encoders:vae", store="mean", dtype="fp32", batch_size=2))
    config = _config(data)
    uses = [(("vae", "mean2"),), (("vae", "mean2"), ("vit", "vitenc"))]
    config = dataclasses.replace(config, groups=tuple(dataclasses.replace(group, encodings=use)
                                                      for group, use in zip(config.groups, uses, strict=True)))
    no_dropout = dataclasses.replace(config, dropout=DropoutConfig(0, 0, 0))
    model, patch, compared = encoders.vit(), VIT.image_stride, 0
    for pixel_config in (config, no_dropout):
        pixels = PackBuilder(dataclasses.replace(pixel_config, groups=tuple(
            dataclasses.replace(group, encodings=()) for group in pixel_config.groups)), special_tokens=SPECIAL)
        encoded = PackBuilder(pixel_config, special_tokens=SPECIAL)
        items = [PackItem(1, 0, s, 0) for s in range(4)] + [PackItem(0, 0, 0, 0)]
        for k, chosen in enumerate((items, items[1::2])):
            want, got = pixels.build(k, chosen), encoded.build(k, chosen)
            if "packed_vit_tokens" not in want.tensors:
                continue
            assert "packed_vit_tokens" not in got.tensors and "padded_images" not in got.tensors
            start, expected = 0, []
            for h, w in _vit_grids(want, config.geometry.max_num_patch_per_side):
                tokens = want.packed_vit_tokens[start:start + h * w]
                image = tokens.view(h, w, patch, patch, 3).permute(4, 0, 2, 1, 3).reshape(1, 3, h * patch, w * patch)
                with torch.no_grad():
                    expected.append(model(image)[0].permute(1, 2, 0).reshape(h * w, -1))
                start += h * w
            torch.testing.assert_close(got.packed_vit_embeddings, torch.cat(expected), rtol=1e-5, atol=1e-5)
            for key in ("packed_vit_token_indexes", "packed_vit_position_ids", "vit_token_seqlens"):
                assert torch.equal(got.tensors[key], want.tensors[key]), key
            compared += 1
    assert compared >= 2  # at least the packs without dropout
    wrong = dataclasses.replace(config, groups=(config.groups[0], dataclasses.replace(
        config.groups[1], encodings=(("vit", "mean2"),))))
    with pytest.raises(ValueError, match="vit needs image encodings of the vit transform"):
        PackBuilder(wrong, special_tokens=SPECIAL)
    precache_dataset(str(data / "edit"), Job("vit8", "support.encoders:vae_mean", transform="vit", dtype="fp32"), VIT,
                     progress=False)  # patches of 8 pixels, not the config's 14
    coarse = dataclasses.replace(no_dropout, groups=(config.groups[0], dataclasses.replace(
        config.groups[1], encodings=(("vit", "vit8"),))))
    with pytest.raises(FormatError, match=r"not \(\d+, \d+, D\) for its"):
        PackBuilder(coarse, special_tokens=SPECIAL).build(0, [PackItem(1, 0, 0, 0)])


def _vit_grids(batch, side):
    """(h, w) in patches of each ViT image of ``batch``, from its position ids (row * side + column)."""
    grids, start = [], 0
    for count in batch.vit_token_seqlens.tolist():
        ids = batch.packed_vit_position_ids[start:start + count]
        width = int((ids % side).max()) + 1
        grids.append((count // width, width))
        start += count
    return grids


def test_text_embeddings_are_packed_per_token_with_their_indexes(data):
    job = Job("txt", "support.encoders:text", modality="text", dtype="fp32", batch_size=2)
    _precache(data, "txt", job)
    builder = PackBuilder(_config(data), special_tokens=SPECIAL, encodings={"text": "txt"})
    pack = builder.build(0, [PackItem(1, 0, 1, 0), PackItem(0, 0, 3, 0)])
    ids = pack.packed_text_ids[torch.searchsorted(pack.packed_text_indexes, pack.packed_text_embedding_indexes)]
    model = encoders.text()
    with torch.no_grad():
        torch.testing.assert_close(pack.packed_text_embeddings, model(ids[None])[0], rtol=1e-6, atol=1e-6)
    assert len(pack.packed_text_embedding_indexes) == 5 + 7  # every caption token, no framing tokens
    assert "padded_images" in pack.tensors  # images untouched


def test_a_text_dataset_gets_one_embedding_per_sequence(tmp_path):
    from mmidx.encodings.precache import precache

    with DatasetBuilder(tmp_path / "t", kind="text", vocab_size=1000) as builder:
        for i in range(3):
            builder.add_document([list(range(3, 6 + i)), [7, 8]])
        builder.finalize()
    (meta,) = precache(str(tmp_path / "t"), Job("tx", "support.encoders:text", modality="text", dtype="fp32"),
                       progress=False)
    assert (meta["counts"]["records"], meta["transform"], meta["store"]) == (6, None, "tensor")
    sample = MMIDXDataset(tmp_path / "t")[2]
    with torch.no_grad():
        expected = encoders.text()(torch.tensor([[3, 4, 5, 6, 7]]))[0]
    torch.testing.assert_close(sample.encoding("tx", 0), expected, rtol=1e-6, atol=1e-6)
    assert sample.encoding("tx", 1).shape == (2, 6)


def _run(folder, *extra, env=None):
    config = folder / "k9.yaml"  # the t2i dataset through the tests' small VAE transform
    config.write_text(json.dumps({"groups": {"t2i": {"datasets": ["t2i"], "image_transform_args": {
        "max_image_size": VAE.max_image_size, "min_image_size": VAE.min_image_size,
        "image_stride": VAE.image_stride}}}}))
    return subprocess.run([sys.executable, "-m", "mmidx.cli", "precache", str(config), "--encoder",
                           "support.encoders:vae", "--name", "k9", "--batch-size", "1", "--quiet", "--workers", "2",
                           *extra],
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
                               **(env or {})}, capture_output=True, text=True, timeout=120)


def test_kill_9_during_precache_then_rerun_is_byte_identical(data):
    job = Job("k9", "support.encoders:vae", batch_size=1)  # what the command line below asks for
    precache_dataset(str(data / "t2i"), job, VAE, progress=False, workers=2)  # the uninterrupted run
    expected = {role: fmt.encoding_path(data / "t2i", "k9", role).read_bytes() for role in fmt.ENCODING_ROLES}
    for role in fmt.ENCODING_ROLES:
        fmt.encoding_path(data / "t2i", "k9", role).unlink()
    killed = _run(data, env={"MMIDX_TEST_KILL_AT_CALL": "4"})
    assert killed.returncode == -9
    assert not fmt.encoding_path(data / "t2i", "k9", "json").exists()
    with pytest.raises(FormatError, match="missing"):
        MMIDXDataset(data / "t2i")[0].encoding("k9", 0)
    partial = Path(str(fmt.encoding_path(data / "t2i", "k9", "idx")) + ".partial")
    assert partial.stat().st_size == 3 * fmt.ENCODING_RECORD.itemsize  # three batches were on disk
    resumed = _run(data, env={"MMIDX_TEST_KILL_AT_CALL": "1"})  # would die if it re-encoded from the start...
    assert resumed.returncode == -9  # ...it does die at its first call: the 4th batch, not the first
    assert partial.stat().st_size == 3 * fmt.ENCODING_RECORD.itemsize
    finished = _run(data, "--device", "cpu", "--workers", "1")
    assert finished.returncode == 0, finished.stderr
    for role in fmt.ENCODING_ROLES:
        assert fmt.encoding_path(data / "t2i", "k9", role).read_bytes() == expected[role], role
    assert not list(data.glob("t2i.enc.k9.*.partial")) and not list(data.glob("t2i.enc.k9.*.job"))


def test_streams_from_other_inputs_are_refused_naming_the_difference(data, tmp_path):
    _precache(data, "ref", Job("ref", "support.encoders:vae_mean", dtype="fp16", batch_size=8))
    other = ImageTransform(max_image_size=48, min_image_size=32, image_stride=16)
    config = DataConfig(groups=(GroupConfig("t2i", (str(data / "t2i"),), image_transform=other,
                                            encodings=(("vae", "ref"),)),))
    with pytest.raises(ValueError, match="max_image_size 64 vs the config's 48"):
        PackBuilder(config, special_tokens=SPECIAL)
    with pytest.raises(ValueError, match="text encodings"):
        PackBuilder(_config(data), special_tokens=SPECIAL, encodings={"text": "ref"})
    copy = tmp_path / "t2i"  # the same files, rebuilt: another dataset checksum
    with DatasetBuilder(copy, vocab_size=1000) as builder:
        builder.add_sample([[5]], [_noise_png(32, 32, 0)], [[Element("vae_image", 0, loss=True)]])
        builder.finalize()
    for role in fmt.ENCODING_ROLES:
        fmt.encoding_path(copy, "ref", role).write_bytes(fmt.encoding_path(data / "t2i", "ref", role).read_bytes())
    with pytest.raises(FormatError, match="another version"):
        MMIDXDataset(copy)[0].encoding("ref", 0)


@pytest.mark.parametrize("role", ["bin", "idx", "json"])
def test_a_truncated_or_corrupted_stream_is_a_format_error_naming_the_file(data, tmp_path, role):
    import shutil

    from mmidx.read.encoding_streams import EncodingStream
    _precache(data, "cut", Job("cut", "support.encoders:vae_mean", dtype="fp32", batch_size=8))
    prefix = tmp_path / "t2i"
    for path in data.glob("t2i.*"):
        if not path.name.endswith(".lock"):
            shutil.copy(path, tmp_path / path.name)
    path = fmt.encoding_path(prefix, "cut", role)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(FormatError, match=str(path)):
        EncodingStream.open(prefix, "cut", MMIDXDataset(prefix).checksum)


@pytest.mark.parametrize(("key", "value"), [("dtype", {}), ("modality", []), ("store", 1),
                                            ("transform_args", True), ("transform_args", 2**31), ("transform", 3)])
def test_an_encoding_json_with_fields_of_the_wrong_type_is_a_format_error(data, tmp_path, key, value):
    """Re-signed JSONs the fuzzer made (tools/fuzz.py, seed 12000): each field's type is checked before use."""
    import shutil

    from mmidx.read.encoding_streams import EncodingStream
    _precache(data, "typed", Job("typed", "support.encoders:vae_mean", dtype="fp32", batch_size=8))
    for path in data.glob("t2i.*"):
        if not path.name.endswith(".lock"):
            shutil.copy(path, tmp_path / path.name)
    path = fmt.encoding_path(tmp_path / "t2i", "typed", "json")
    meta = json.loads(path.read_bytes())
    meta[key] = value
    path.write_bytes(fmt.serialize_metadata(meta))
    with pytest.raises(FormatError, match=f"{path}.*{key}"):
        EncodingStream.open(tmp_path / "t2i", "typed", MMIDXDataset(tmp_path / "t2i").checksum)


def _copy(data, folder, name):
    import shutil

    for path in data.glob("*"):
        dataset_file = path.name.endswith((".idx", ".bin", ".images", ".plan", ".json"))
        if dataset_file and (".enc." not in path.name or f".enc.{name}." in path.name):
            shutil.copy(path, folder / path.name)
    return folder


def test_verify_and_inspect_know_encodings(data, tmp_path, capsys):
    from mmidx.cli import main
    from mmidx.read.checks import summary, verify

    _precache(data, "vi", Job("vi", "support.encoders:vae_mean", dtype="fp16", batch_size=8, weights_version="v1"))
    folder = _copy(data, tmp_path, "vi")
    assert verify(folder / "edit") == []
    info = summary(MMIDXDataset(folder / "edit"))["encodings"]
    assert [(e["name"], e["records"], e["store"], e["weights_version"]) for e in info] == [("vi", 8, "tensor", "v1")]
    assert main(["inspect", str(folder / "edit")]) == 0
    assert "encoding vi      8 image records (tensor, fp16" in capsys.readouterr().out
    path = fmt.encoding_path(folder / "edit", "vi", "bin")
    raw = bytearray(path.read_bytes())
    raw[100] ^= 1
    path.write_bytes(bytes(raw))
    problems = verify(folder / "edit")
    assert len(problems) == 1 and str(path) in problems[0] and "checksum" in problems[0]
    assert main(["verify", str(folder / "edit")]) == 1


def test_bench_reports_latents_against_pixels_from_a_data_yaml(data, tmp_path, capsys):
    import yaml

    from mmidx.cli import main
    folder = _copy(data, tmp_path, "none")
    transform = {"max_image_size": 64, "min_image_size": 32, "image_stride": 16}
    spec = {"groups": {"t2i": {"datasets": ["t2i"], "image_transform_args": transform},
                       "edit": {"datasets": ["edit"], "image_transform_args": transform,
                                "vit_image_transform_args": {"max_image_size": 56, "min_image_size": 28,
                                                             "image_stride": 14}}},
            "packing": {"expected_num_tokens": 200, "max_num_tokens": 400, "max_num_tokens_per_sample": 200,
                        "prefer_buffer_before": 100, "max_buffer_size": 4}}
    (folder / "data.yaml").write_text(yaml.safe_dump(spec))
    assert main(["precache", str(folder / "data.yaml"), "--encoder", "support.encoders:vae", "--name", "b",
                 "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split(" of ")[0] for line in lines) == ["b: 6 image encodings (moments, bf16)",
                                                               "b: 8 image encodings (moments, bf16)"]
    assert main(["bench", str(folder / "data.yaml"), "--encodings", "b", "--packs", "3", "--workers", "0",
                 "--masks", "none"]) == 0
    out = capsys.readouterr().out
    assert "the same with precached latents (b: padded_latent instead of padded_images)" in out
    assert "tokens/s with latents" in out
    spec["groups"]["t2i"]["encodings"] = spec["groups"]["edit"]["encodings"] = {"vae": "b"}
    (folder / "data.yaml").write_text(yaml.safe_dump(spec))
    from mmidx.train.bagel import trainer_loader

    loader = trainer_loader(folder / "data.yaml", special_tokens=SPECIAL, expected_num_tokens=200, max_num_tokens=400,
                            max_num_tokens_per_sample=200, prefer_buffer_before=100, max_buffer_size=4)
    data = next(iter(loader)).to_dict()
    assert "padded_latent" in data and "padded_images" not in data
    assert len(data["padded_latent"]) == len(data["patchified_vae_latent_shapes"])


def test_a_second_precache_of_the_same_stream_is_refused_while_one_runs(data):
    from mmidx.io.lock import OutputLockedError, output_lock

    with (output_lock(f"{data / 't2i'}.enc.busy", "precache"),
          pytest.raises(OutputLockedError, match="another precache")):
        precache_dataset(str(data / "t2i"), Job("busy", "support.encoders:vae"), VAE, progress=False)
    assert not list(data.glob("t2i.enc.busy.*"))  # nothing written


def test_a_finished_stream_of_other_options_is_replaced_only_with_force(data, capsys):
    from mmidx.cli import main

    prefix = str(data / "t2i")
    argv = ["precache", prefix, "--encoder", "support.encoders:vae", "--name", "kept", "--quiet", "--dtype"]
    assert main([*argv, "fp32", "--batch-size", "2"]) == 0
    stream = {role: fmt.encoding_path(prefix, "kept", role).read_bytes() for role in fmt.ENCODING_ROLES}
    assert main([*argv, "fp32", "--batch-size", "4"]) == 0  # the same options (another batch): the same stream
    assert {role: fmt.encoding_path(prefix, "kept", role).read_bytes() for role in fmt.ENCODING_ROLES} == stream
    capsys.readouterr()
    assert main([*argv, "bf16"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"mmidx precache: {prefix}.enc.kept.json: encoding 'kept' was computed with other options (dtype 'fp32' vs "
        "'bf16'); pass --force to replace it, or choose another --name")
    assert {role: fmt.encoding_path(prefix, "kept", role).read_bytes() for role in fmt.ENCODING_ROLES} == stream
    assert main([*argv, "bf16", "--force"]) == 0
    assert json.loads(fmt.encoding_path(prefix, "kept", "json").read_text())["dtype"] == "bf16"
