"""The seed's precache config: several encoders in one pass (an image VAE and a text encoder reading strings),
text-input encodings in packs, a token-input one still packed per token, the same on a dataset in S3
(moto's server), and a two-encoder run killed with SIGKILL resumed byte-identically."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from support import encoders
from support.precache import SPECIAL, VAE, make_captioned
from support.sources import loaded_tokenizer

from mmidx import format as fmt
from mmidx.cli import main
from mmidx.config import DataConfig, DropoutConfig, GroupConfig, PackingConfig
from mmidx.encodings.spec import PrecacheConfigError, jobs_of
from mmidx.index.pack_index import PackItem
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset

TESTS = Path(__file__).parent
CONFIG = {"encodings": [
    {"modality": "image", "key": "vae", "precision": 32, "encoder_config": {"cls": "support.encoders:vae"}},
    {"modality": "text", "key": "t5", "precision": "fp32", "store_pad_tokens": False,
     "encoder_config": {"cls": "support.encoders.StringText", "dim": 5}},
    {"modality": "text", "key": "tok", "precision": 32, "input": "tokens",
     "encoder_config": {"cls": "support.encoders:text"}}]}
TRANSFORM = {"max_image_size": VAE.max_image_size, "min_image_size": VAE.min_image_size,
             "image_stride": VAE.image_stride}


@pytest.fixture(scope="module")
def captioned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cfg")
    prefix = make_captioned(folder, loaded_tokenizer())
    (folder / "precache.yaml").write_text(yaml.safe_dump(CONFIG))
    (folder / "data.yaml").write_text(yaml.safe_dump({"groups": {"t2i": {
        "datasets": [str(prefix)], "image_transform_args": TRANSFORM}}}))
    return folder, prefix


@pytest.fixture(scope="module")
def precached(captioned):
    """The three-entry config run once over the local dataset: (folder, prefix, the lines it printed)."""
    import contextlib
    import io

    folder, prefix = captioned
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["precache", str(folder / "data.yaml"), "--config", str(folder / "precache.yaml"), "--quiet",
                     "--batch-size", "2"]) == 0
    return folder, prefix, out.getvalue().splitlines()


def _builder(prefix, **cache):
    config = DataConfig(groups=(GroupConfig("t2i", (str(prefix),), image_transform=VAE,
                                            encodings=(("vae", "vae"), ("t5", "t5"), ("text", "tok"))),),
                        dropout=DropoutConfig(0.3, 0, 0), seed=3)
    return PackBuilder(config, special_tokens=SPECIAL, **cache)


def _packs(builder, count=6):
    return [builder.build(k, [PackItem(0, 0, s, 0) for s in range(k % 2, count, 2)]) for k in range(4)]


def test_a_config_entry_with_an_unknown_key_is_refused_listing_the_known_ones(tmp_path, capsys):
    bad = {"encodings": [{**CONFIG["encodings"][0], "extension": "pkl"}]}
    with pytest.raises(PrecacheConfigError, match=r"unknown keys \['extension'\]; the known ones are \['modality'"):
        jobs_of(bad, "p.yaml")
    with pytest.raises(PrecacheConfigError, match=r"unknown keys \['encoding'\]; the known ones are \['encodings'\]"):
        jobs_of({"encoding": []}, "p.yaml")
    with pytest.raises(PrecacheConfigError, match="store_pad_tokens: false needs input: text"):
        jobs_of({"encodings": [{**CONFIG["encodings"][2], "store_pad_tokens": False}]}, "p.yaml")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(bad))
    assert main(["precache", str(tmp_path), "--config", str(tmp_path / "p.yaml")]) != 0
    error = capsys.readouterr().err.strip()
    assert "extension" in error and "modality" in error and len(error.splitlines()) == 1


def test_two_encoders_run_once_write_both_streams_and_packs_carry_their_outputs(precached, capsys):
    _, prefix, lines = precached
    assert sorted(line.split(":")[0] for line in lines) == ["t5", "tok", "vae"]
    assert main(["verify", str(prefix)]) == 0
    assert main(["inspect", str(prefix)]) == 0
    out = capsys.readouterr().out
    assert all(f"encoding {name}" in out for name in ("vae", "t5", "tok"))
    meta = json.loads(fmt.encoding_path(prefix, "t5", "json").read_text())
    assert (meta["format_version"], meta["input"], meta["store_pad_tokens"]) == (2, "text", False)
    assert json.loads(fmt.encoding_path(prefix, "vae", "json").read_text())["format_version"] == 1
    vae, text, tokens = encoders.vae(), encoders.StringText(dim=5), encoders.text()
    pixels = PackBuilder(DataConfig(groups=(GroupConfig("t2i", (str(prefix),), image_transform=VAE),),
                                    dropout=DropoutConfig(0.3, 0, 0), seed=3), special_tokens=SPECIAL)
    dataset, tokenizer, rows = MMIDXDataset(prefix), loaded_tokenizer(), 0
    for want, got in zip(_packs(pixels), (batch.to("cpu") for batch in _packs(_builder(prefix))), strict=True):
        for slot, (h, w) in enumerate(want.patchified_vae_latent_shapes):
            with torch.no_grad():
                mean, logvar = vae(want.padded_images[slot:slot + 1, :, :h * 16, :w * 16])
            latent = got.padded_latent[slot, :, :2 * h, :2 * w]  # mean + exp(logvar / 2) * noise: |noise| < 6
            assert torch.all((latent - mean[0]).abs() <= 6 * torch.exp(0.5 * logvar[0]) + 1e-4)
        values, lengths, samples, elements = (got.tensors[key] for key in (
            "text_encoding_t5", "text_encoding_t5_lengths", "text_encoding_t5_samples", "text_encoding_t5_elements"))
        items = [d["sample"] for d in got.batch_data_indexes]
        assert elements.tolist() == [0] * len(samples)  # the caption is element 0 of every view
        for row, (sample, length) in enumerate(zip(samples.tolist(), lengths.tolist(), strict=True)):
            string = tokenizer.decode(dataset[items[sample]].text(0).tolist())
            with torch.no_grad():
                expected, mask = text.encode([string])
            torch.testing.assert_close(values[row, :length], expected[0][mask[0].bool()], rtol=1e-6, atol=1e-6)
            assert not values[row, length:].any()
            rows += 1
        ids = got.packed_text_ids[torch.searchsorted(got.packed_text_indexes, got.packed_text_embedding_indexes)]
        with torch.no_grad():
            torch.testing.assert_close(got.packed_text_embeddings, tokens(ids[None])[0], rtol=1e-6, atol=1e-6)
    assert rows >= 6  # captions kept by dropout 0.3 over 4 packs


def test_the_same_on_a_dataset_in_s3_gives_batches_identical_to_a_local_copys(precached, s3, capsys):
    folder, prefix, _ = precached
    uri = s3.upload(prefix, "s3://mmidx/precached/cap")
    s3.client.put_object(Bucket="mmidx", Key="precached/data.yaml", Body=yaml.safe_dump(  # the dataset beside it
        {"groups": {"t2i": {"datasets": ["cap"], "image_transform_args": TRANSFORM}}}).encode())
    assert main(["precache", "s3://mmidx/precached/data.yaml", "--config", str(folder / "precache.yaml"), "--quiet",
                 "--batch-size", "2"]) == 0
    keys = sorted(name for name in s3.client.list_objects_v2(Bucket="mmidx", Prefix="precached/")["Contents"]
                  for name in [name["Key"]] if ".enc." in name)
    assert keys == sorted(f"precached/cap.enc.{n}.{r}" for n in ("t5", "tok", "vae") for r in ("bin", "idx", "json"))
    for name in ("vae", "t5", "tok"):  # the same bytes as the local run's
        for role in fmt.ENCODING_ROLES:
            body = s3.client.get_object(Bucket="mmidx", Key=f"precached/cap.enc.{name}.{role}")["Body"].read()
            assert body == fmt.encoding_path(prefix, name, role).read_bytes(), (name, role)
    capsys.readouterr()
    assert main(["verify", uri]) == 0 and main(["inspect", uri]) == 0
    out = capsys.readouterr().out
    assert all(f"encoding {name}" in out for name in ("vae", "t5", "tok"))
    remote = _builder(uri)
    assert remote.datasets[0][0].remote_files
    for local_batch, remote_batch in zip(_packs(_builder(prefix)), _packs(remote), strict=True):
        want, got = local_batch.to("cpu").to_dict(), remote_batch.to("cpu").to_dict()
        assert sorted(want) == sorted(got)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, got[key]), key
            elif key != "batch_data_indexes":
                assert value == got[key], key
    from mmidx.index.pack_index import build_pack_index
    from mmidx.train.loader import PackDataset, PackLoader

    fresh = _builder(uri)  # through the loader: the records are fetched ahead with the pack's other ranges
    packs = PackDataset(build_pack_index(dataclasses.replace(fresh.config, packing=PackingConfig(
        expected_num_tokens=60, max_num_tokens=120, max_num_tokens_per_sample=60, prefer_buffer_before=30,
        max_buffer_size=4)), num_samples=12), fresh)
    assert len(list(PackLoader(packs, global_batch_size=1))) >= 2
    streams = fresh.datasets[0][0]._files.encodings.values()
    assert sorted(stream.name for stream in streams) == ["t5", "tok", "vae"]
    assert all(stream.values.misses == 0 and stream.values.requests > 0 for stream in streams)


def test_offline_a_remote_dataset_and_its_encodings_open_from_the_nodes_cache_alone(precached, s3, tmp_path):
    import socket

    from mmidx.io.cache_folder import create

    _, prefix, _ = precached
    uri = s3.upload(prefix, "s3://mmidx/offline/cap")
    for name in ("vae", "t5", "tok"):
        for role in fmt.ENCODING_ROLES:  # data first, the JSON last, as a precache uploads them
            s3.client.upload_file(str(fmt.encoding_path(prefix, name, role)), "mmidx", f"offline/cap.enc.{name}.{role}")
    cache = tmp_path / "cache"
    create(cache, 4096)
    online = _builder(uri, cache_dir=cache, cache_limit="64MiB")
    dataset = online.datasets[0][0]
    for file in [*dataset.remote_files.values(), *(stream.values for stream in dataset._files.encodings.values())]:
        assert len(file[0:len(file)]) == len(file)  # every block read once through the data cache
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"{uri}?endpoint_override=127.0.0.1:{probe.getsockname()[1]}&scheme=http"  # no store answers there
    offline = _builder(closed, cache_dir=cache, cache_limit="64MiB", cache_offline=True)
    for want, got in zip(_packs(_builder(prefix)), _packs(offline), strict=True):
        want, got = want.to("cpu").to_dict(), got.to("cpu").to_dict()
        assert sorted(want) == sorted(got)
        for key, value in want.items():
            assert torch.equal(value, got[key]) if isinstance(value, torch.Tensor) else \
                key == "batch_data_indexes" or value == got[key], key

def _run(folder, env=None):
    return subprocess.run([sys.executable, "-m", "mmidx.cli", "precache", str(folder / "data.yaml"), "--config",
                           str(folder / "k9.yaml"), "--quiet", "--batch-size", "1"],
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
                               **(env or {})}, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(900)  # over half the default: two precache runs in subprocesses: 196 s at a load of 20
def test_kill_9_during_a_two_encoder_precache_then_rerun_is_byte_identical(captioned):
    folder, prefix = captioned
    config = {"encodings": [{**entry, "key": f"k9{entry['key']}"} for entry in CONFIG["encodings"]]}
    (folder / "k9.yaml").write_text(yaml.safe_dump(config))
    names = ("k9vae", "k9t5", "k9tok")
    assert _run(folder).returncode == 0
    expected = {(n, r): fmt.encoding_path(prefix, n, r).read_bytes() for n in names for r in fmt.ENCODING_ROLES}
    for name, role in expected:
        fmt.encoding_path(prefix, name, role).unlink()
    # calls: the image pass (6 images, one a batch) 1-6; the text pass, t5 then tok per caption: killed in the
    # second caption's batch, with the first batch of both text streams on disk
    killed = _run(folder, {"MMIDX_TEST_KILL_AT_CALL": "9"})
    assert killed.returncode == -9, killed.stderr
    assert fmt.encoding_path(prefix, "k9vae", "json").exists()  # its pass had finished
    assert not any(fmt.encoding_path(prefix, name, "json").exists() for name in names[1:])
    for name in names[1:]:
        table = Path(str(fmt.encoding_path(prefix, name, "idx")) + ".partial")
        assert table.stat().st_size == fmt.ENCODING_RECORD.itemsize  # one whole batch each
    resumed = _run(folder)
    assert resumed.returncode == 0, resumed.stderr
    for (name, role), content in expected.items():
        assert fmt.encoding_path(prefix, name, role).read_bytes() == content, (name, role)
    assert not list(folder.glob("cap.enc.*.partial")) and not list(folder.glob("cap.enc.*.job"))


def test_a_text_input_stream_serves_only_under_its_own_name_and_a_token_stream_only_as_text(precached):
    _, prefix, _ = precached
    for uses, says in (((("text", "t5"),), "use it under its own name, not as text"),
                       ((("t5", "tok"),), "use it as text, not as t5"),
                       ((("t5", "vae"),), "t5 needs text encodings")):
        config = DataConfig(groups=(GroupConfig("t2i", (str(prefix),), image_transform=VAE, encodings=uses),))
        with pytest.raises(ValueError, match=says):
            PackBuilder(config, special_tokens=SPECIAL)


def test_a_version_2_stream_without_its_input_field_is_a_format_error(precached, tmp_path):
    import shutil

    from mmidx.format import FormatError
    from mmidx.read.encoding_streams import EncodingStream

    _, prefix, _ = precached
    for path in prefix.parent.glob("cap.*"):
        if not path.name.endswith((".lock", ".partial", ".job")):
            shutil.copy(path, tmp_path / path.name)
    path = fmt.encoding_path(tmp_path / "cap", "t5", "json")
    meta = json.loads(path.read_bytes())
    del meta["input"]
    path.write_bytes(fmt.serialize_metadata(meta))  # re-signed: only the field check can tell
    with pytest.raises(FormatError, match=rf"{path}.*\['input'\]"):
        EncodingStream.open(tmp_path / "cap", "t5", MMIDXDataset(tmp_path / "cap").checksum)
    meta["input"], meta["format_version"] = "text", 3
    path.write_bytes(fmt.serialize_metadata(meta))
    with pytest.raises(FormatError, match="version 3; this mmidx reads 1 to 2"):
        EncodingStream.open(tmp_path / "cap", "t5", MMIDXDataset(tmp_path / "cap").checksum)


def test_a_text_input_encoding_of_a_dataset_without_a_tokenizer_is_one_clear_error(tmp_path, capsys):
    from support.precache import make_datasets

    make_datasets(tmp_path)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"encodings": [CONFIG["encodings"][1]]}))
    assert main(["precache", str(tmp_path / "t2i"), "--config", str(tmp_path / "p.yaml"), "--quiet"]) != 0
    error = capsys.readouterr().err.strip()
    assert "records no tokenizer" in error and "--tokenizer" in error and len(error.splitlines()) == 1
    assert not list(tmp_path.glob("t2i.enc.t5.json"))
