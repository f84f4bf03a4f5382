"""Datasets in object storage (moto's S3 server on 127.0.0.1): the same batches and samples as from
local files, reads fetched ahead by the known order (requests counted), one line per bad URI."""

import json
import shutil
import socket

import numpy as np
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from support.packing import build_groups, config_of
from support.s3_process import S3Process

from mmidx.cli import main
from mmidx.config import DataConfig
from mmidx.index.pack_index import build_pack_index
from mmidx.ingest.writer import DatasetBuilder
from mmidx.io.storage import StorageError
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.train.gpt import GPTTextDataset
from mmidx.train.loader import PackDataset, PackLoader


@pytest.fixture(scope="module")
def stored(s3, tmp_path_factory):
    """t2i, edit and vlm datasets and a text dataset, on disk and uploaded to the S3 server."""
    folder = tmp_path_factory.mktemp("remote")
    groups = build_groups(folder)
    rng = np.random.default_rng(0)
    with DatasetBuilder(folder / "text", kind="text", vocab_size=1000, special_tokens={"eod": 0}) as builder:
        for _ in range(30):
            builder.add_document([np.append(rng.integers(1, 1000, rng.integers(1, 50)), 0)])
        builder.finalize()
    remote_groups = {name: {**group, "datasets": [s3.upload(group["datasets"][0], f"s3://mmidx/data/{name}")]}
                     for name, group in groups.items()}
    return {"local": groups, "remote": remote_groups, "text": folder / "text",
            "remote_text": s3.upload(folder / "text", "s3://mmidx/data/text")}


def packs_of(groups, num_samples=120):
    config = config_of(groups, dropout={"text": 0.3, "vit": 0.3, "vae": 0.3})
    return PackDataset(build_pack_index(config, num_samples=num_samples), PackBuilder(config))


def everything(batch):
    """Every key of a batch, comparable with ==; where it was read (dataset location, worker) aside."""
    data = batch.to_dict()
    found = {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in data.items()
             if key not in ("batch_data_indexes", "attention_mask")}
    found["batch_data_indexes"] = [{k: v for k, v in d.items() if k not in ("dataset", "worker_id")}
                                   for d in data["batch_data_indexes"]]
    return found


def test_packs_from_s3_equal_packs_from_local_files_for_0_1_2_workers_and_a_resume(stored):
    local, remote = packs_of(stored["local"]), packs_of(stored["remote"])
    assert remote.builder.datasets[0][0].remote_files  # really read by range
    expected = [everything(b) for b in PackLoader(local, global_batch_size=2)]
    assert len(expected) >= 4 and max(len({d["dataset_name"] for d in b["batch_data_indexes"]}) for b in expected) == 3
    for workers in (0, 2):  # and 1 in the resumed run below
        assert [everything(b) for b in PackLoader(remote, global_batch_size=2, num_workers=workers)] == expected
    loader, taken = PackLoader(remote, global_batch_size=2, num_workers=2), []
    for batch in loader:
        taken.append(everything(batch))
        if len(taken) == 3:
            break
    resumed = PackLoader(remote, global_batch_size=2, num_workers=1)
    resumed.load_state_dict(loader.state_dict())
    assert taken + [everything(b) for b in resumed] == expected


def test_a_data_yaml_in_s3_finds_its_relative_datasets_beside_it(stored, s3):
    spec = {"groups": {name: {**group, "datasets": [name]} for name, group in stored["local"].items()}, "seed": 4}
    s3.client.put_object(Bucket="mmidx", Key="data/data.yaml", Body=yaml.safe_dump(spec, sort_keys=False).encode())
    config = DataConfig.from_yaml("s3://mmidx/data/data.yaml")
    assert config == DataConfig.from_dict({**spec, "groups": stored["remote"]})
    assert config.groups[0].datasets == ("s3://mmidx/data/t2i",)


@pytest.fixture
def second_store():
    """Another S3 server, with a bucket ``mmidx`` too: the same keys as the ``s3`` fixture's, other objects."""
    server = S3Process()
    server.client.create_bucket(Bucket="mmidx")
    yield server
    server.stop()


def test_a_data_yaml_opened_with_a_query_reads_its_datasets_from_the_querys_store(stored, s3, second_store, capsys):
    """The data.yaml's query names its store: its relative datasets are read from there, not from the default
    endpoint's store, which holds another dataset at the same key; the commands take the URI as a data YAML."""
    ours, theirs = (MMIDXDataset(stored["local"][name]["datasets"][0]) for name in ("t2i", "vlm"))
    assert len(ours) != len(theirs)
    second_store.upload(ours.prefix, "mix/ds")
    spec = {"groups": {"t2i": {**stored["local"]["t2i"], "datasets": ["ds"]}}}
    second_store.client.put_object(Bucket="mmidx", Key="mix/data.yaml", Body=yaml.safe_dump(spec).encode())
    s3.upload(theirs.prefix, "s3://mmidx/mix/ds")
    query = f"endpoint_override={second_store.endpoint}&scheme=http"
    uri = f"s3://mmidx/mix/data.yaml?{query}"
    config = DataConfig.from_yaml(uri)
    assert config.groups[0].datasets == (f"s3://mmidx/mix/ds?{query}",)
    assert MMIDXDataset(config.groups[0].datasets[0]).checksum == ours.checksum != theirs.checksum
    assert main(["inspect", uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == len(ours)
    assert main(["index", uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"] == {"t2i": len(ours)}


@pytest.mark.parametrize("kind", ["t2i", "edit", "vlm"])
def test_packs_of_one_kind_from_s3_equal_local_ones(stored, kind):
    local, remote = (packs_of({kind: stored[where][kind]}, num_samples=30) for where in ("local", "remote"))
    expected = [everything(b) for b in PackLoader(local, global_batch_size=1)]
    assert expected and [everything(b) for b in PackLoader(remote, global_batch_size=1)] == expected


def test_reads_are_served_from_chunks_fetched_ahead_in_few_requests(stored):
    remote = packs_of(stored["remote"])
    files = [file for group in remote.builder.datasets for dataset in group for file in dataset.remote_files.values()]
    batches = list(PackLoader(remote, global_batch_size=2))  # in this process: its requests are countable
    requests = sum(file.requests for file in files)
    assert sum(file.misses for file in files) == 0  # every read found its bytes fetched ahead
    assert requests <= len(files) * len(batches)  # one coalesced request per data file per pack at most here
    assert all(not file._chunks for file in files)  # dropped after use
    direct = packs_of(stored["remote"])  # without the loader: each read is one request
    for k in range(len(batches)):
        direct.builder.build(k, direct.packs.items(k))
    direct_files = [file for group in direct.builder.datasets for d in group for file in d.remote_files.values()]
    assert sum(file.misses for file in direct_files) == sum(file.requests for file in direct_files) > requests


def test_gpt_samples_and_samples_from_s3_equal_local_ones(stored, s3):
    local, remote = (GPTTextDataset(prefix, seq_length=24, seed=3)
                     for prefix in (stored["text"], stored["remote_text"]))
    assert len(local) == len(remote)
    for i in range(len(local)):
        assert all(torch.equal(a, b) for a, b in zip(local[i].values(), remote[i].values(), strict=True))
    prefix = stored["local"]["edit"]["datasets"][0]
    with_query = f"s3://mmidx/data/edit?endpoint_override={s3.endpoint}&scheme=http"  # options kept on every file
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")  # only the query reaches S3
        opened = MMIDXDataset(with_query)
        opened[0].images  # noqa: B018 (a read through the query's endpoint)
    for dataset in (opened, MMIDXDataset(stored["remote"]["edit"]["datasets"][0])):
        for i, sample in enumerate(MMIDXDataset(prefix)):
            theirs = dataset[i]
            assert all(np.array_equal(a, b) for a, b in zip(sample.texts, theirs.texts, strict=True))
            assert [bytes(a.data) for a in sample.images] == [bytes(b.data) for b in theirs.images]


def closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(("uri", "says"), [
    ("s3://no-such-bucket/data/t2i", "bucket 'no-such-bucket' does not exist"),
    ("s3://mmidx/data/missing", "no such object"),
    ("s3://mmidx/data/t2i?endpoint_override=127.0.0.1:{port}&scheme=http", "cannot reach the storage endpoint"),
])
def test_a_bad_uri_is_one_error_naming_it(stored, uri, says):
    uri = uri.format(port=closed_port())
    with pytest.raises(StorageError, match=says) as error:
        MMIDXDataset(uri)
    assert str(error.value).startswith(uri.split("?")[0]) and "\n" not in str(error.value)


def test_refused_credentials_are_one_error_naming_the_uri(stored):
    from moto import settings

    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # the server now checks keys: "testing" is unknown to it
    try:
        with pytest.raises(StorageError, match="access denied: check the credentials"):
            MMIDXDataset("s3://mmidx/data/vlm")
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")


def test_an_object_shorter_than_the_metadata_says_is_refused(stored, s3):
    prefix = stored["local"]["vlm"]["datasets"][0]
    uri = s3.upload(prefix, "s3://mmidx/short/vlm")
    s3.client.put_object(Bucket="mmidx", Key="short/vlm.images", Body=open(f"{prefix}.images", "rb").read()[:-5])
    with pytest.raises(StorageError, match=r"s3://mmidx/short/vlm.images: object shorter than the metadata says"):
        MMIDXDataset(uri)
    dataset = MMIDXDataset(stored["remote"]["vlm"]["datasets"][0])  # truncated after it was opened
    s3.client.put_object(Bucket="mmidx", Key="data/vlm.images", Body=open(f"{prefix}.images", "rb").read()[:-5])
    try:
        with pytest.raises(StorageError, match="object shorter than the metadata says"):
            dataset[len(dataset) - 1].images  # noqa: B018 (the read is the test)
    finally:
        s3.client.upload_file(f"{prefix}.images", "mmidx", "data/vlm.images")


def test_build_to_s3_uploads_index_and_metadata_last_and_a_rerun_reuses_it(s3, tmp_path, monkeypatch):
    from support.sources import build, write_jsonl

    from mmidx.io import storage

    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"document number {i} " * (i + 1)} for i in range(12)])
    local, _ = build("text", [path], tmp_path / "local")
    uploaded = []

    def killed_after_the_data(source, uri):
        if uri.endswith(".idx"):
            raise KeyboardInterrupt  # the build is killed while uploading
        uploaded.append(uri)
        real_upload(source, uri)

    real_upload = storage.upload
    monkeypatch.setattr(storage, "upload", killed_after_the_data)
    uri = "s3://mmidx/built/docs"
    with pytest.raises(KeyboardInterrupt):
        build("text", [path], uri)
    assert uploaded == [f"{uri}.bin"]
    with pytest.raises(StorageError, match="no such object"):  # what was uploaded does not open
        MMIDXDataset(uri)
    monkeypatch.setattr(storage, "upload", real_upload)
    remote, report = build("text", [path], uri)
    assert report.ok and report.message.endswith(f"uploaded to {uri}") and report.data["reused_units"] == 0
    assert report.message.startswith("already built")  # the killed run's local dataset was reused
    assert np.array_equal(remote.gather(np.arange(len(remote.tokens)))[0],
                          local.gather(np.arange(len(local.tokens)))[0])
    _, again = build("text", [path], uri)
    assert again.message.endswith(f"already at {uri}")


def test_a_build_to_s3_replaces_another_builds_dataset_there_only_with_force(s3, tmp_path):
    from support.sources import build, write_jsonl

    from mmidx.ingest import BuildError
    from mmidx.ingest.remote import scratch_prefix

    uri = "s3://mmidx/occupied/docs"
    first = write_jsonl(tmp_path / "first.jsonl", [{"text": f"first {i}"} for i in range(4)])
    second = write_jsonl(tmp_path / "second.jsonl", [{"text": f"second {i}"} for i in range(6)])
    build("text", [first], uri)
    shutil.rmtree(scratch_prefix(uri).parent)  # the second build runs on another machine: no local scratch
    with pytest.raises(BuildError, match=f"{uri} holds a dataset built from other inputs or options; pass "
                                         "force=True to replace it"):
        build("text", [second], uri)
    assert len(MMIDXDataset(uri)) == 4  # untouched
    remote, report = build("text", [second], uri, force=True)
    assert report.ok and len(remote) == 6


def test_fetch_replaces_another_dataset_of_the_same_name_only_with_force(s3, tmp_path, capsys):
    from support.helpers import small_dataset

    from mmidx.cli import main
    from mmidx.ingest import report_path

    small_dataset(tmp_path / "remote" / "vlm", seed=1)
    uri = s3.upload(tmp_path / "remote" / "vlm", "s3://mmidx/fetched/vlm")
    small_dataset(tmp_path / "copy" / "vlm", seed=2)  # another dataset of that name, with a report of its own
    report_path(tmp_path / "copy" / "vlm").write_text('{"about": "the local dataset"}')
    before = {path.name: path.read_bytes() for path in (tmp_path / "copy").iterdir()}
    assert main(["fetch", uri, "-o", str(tmp_path / "copy")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"mmidx fetch: {tmp_path / 'copy' / 'vlm'} holds another dataset than {uri} (its metadata differs); pass "
        "--force to replace it, or fetch into another folder")
    assert {path.name: path.read_bytes() for path in (tmp_path / "copy").iterdir()} == before
    assert main(["fetch", uri, "-o", str(tmp_path / "copy"), "--force"]) == 0
    assert not report_path(tmp_path / "copy" / "vlm").exists()  # it described the dataset replaced
    for suffix in (".idx", ".bin", ".images", ".plan", ".meta.json"):
        assert (tmp_path / "copy" / f"vlm{suffix}").read_bytes() == (tmp_path / "remote" / f"vlm{suffix}").read_bytes()
    assert main(["fetch", uri, "-o", str(tmp_path / "copy")]) == 0  # the same dataset: fetched again, no --force
    assert main(["fetch", uri, str(tmp_path / "old-form")]) == 0  # the folder last: deprecated, one line says so
    assert "mmidx fetch: warning: the folder as a last argument" in capsys.readouterr().err


def test_fetch_inspect_and_verify_take_uris(s3, tmp_path, capsys):
    from support.helpers import small_dataset

    from mmidx.cli import main
    from mmidx.read.checks import _verify_images as verify_images

    small_dataset(tmp_path / "vlm")  # real PNGs, which verify probes
    original, uri = str(tmp_path / "vlm"), s3.upload(tmp_path / "vlm", "s3://mmidx/verified/vlm")
    assert main(["verify", uri]) == 0 and f"{uri}: OK (checksums and structure verified" in capsys.readouterr().out
    assert main(["inspect", uri, "--json"]) == 0 and '"vlm.images"' in capsys.readouterr().out
    dataset = MMIDXDataset(uri)
    assert verify_images(dataset, decode=True) == []
    images = dataset.remote_files["images"]
    assert (images.requests, images.misses) == (1, 0)  # verify reads the images by windows, not one by one
    assert main(["fetch", uri, "-o", str(tmp_path / "copy")]) == 0
    assert f"fetched from {uri} and verified" in capsys.readouterr().out
    for suffix in (".idx", ".bin", ".images", ".plan", ".meta.json"):
        assert (tmp_path / "copy" / f"vlm{suffix}").read_bytes() == open(original + suffix, "rb").read()
    assert main(["fetch", "s3://mmidx/data/nothing", "-o", str(tmp_path / "none")]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("mmidx fetch: s3://mmidx/data/nothing.meta.json: no such object") and "\n" not in error


def test_megatron_reads_an_mmidx_token_stream_from_s3_through_its_s3_config(stored, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.object_storage_utils import S3Config, cache_index_file, get_index_cache_path

    local, uri = MMIDXDataset(stored["text"]), stored["remote_text"]
    config = S3Config(path_to_idx_cache=str(tmp_path))
    cache_index_file(f"{uri}.idx", get_index_cache_path(f"{uri}.idx", config))  # as Megatron's dataset builder does
    theirs = IndexedDataset(uri, mmap=False, object_storage_config=config)
    assert len(theirs) == len(local.tokens)
    assert np.array_equal(theirs.document_indices, local.tokens.document_indices)
    for i in range(len(theirs)):
        assert np.array_equal(theirs[i], local.get_tokens(i))


def test_a_small_file_that_differs_from_its_checksum_is_refused_and_not_cached(s3, tmp_path):
    from support.helpers import small_dataset

    prefix = tmp_path / "t2i"
    small_dataset(prefix, seed=7)  # never opened before: nothing of it is in the cache
    uri = s3.upload(prefix, "s3://mmidx/replaced/t2i")
    plan = bytearray(open(f"{prefix}.plan", "rb").read())
    plan[-1] ^= 1
    s3.client.put_object(Bucket="mmidx", Key="replaced/t2i.plan", Body=bytes(plan))
    for _ in range(2):  # not cached: refused again
        with pytest.raises(StorageError, match=r"replaced/t2i.plan: its xxh3_128 checksum or size differs"):
            MMIDXDataset(uri)
    s3.client.put_object(Bucket="mmidx", Key="replaced/t2i.meta.json", Body=b"{}")
    with pytest.raises(StorageError, match=r"^s3://mmidx/replaced/t2i.meta.json: not mmidx metadata"):
        MMIDXDataset(uri)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 400)), max_size=30), st.integers(0, 300),
       st.integers(1, 1500))
def test_coalesced_ranges_cover_every_range_sorted_and_bounded(pairs, gap, max_chunk):
    from mmidx.read.prefetch import coalesce

    ranges = [(start, start + length) for start, length in pairs]
    merged = coalesce(ranges, gap, max_chunk)
    assert all(a < b for a, b in merged) and [a for a, _ in merged] == sorted(a for a, _ in merged)
    for start, stop in ranges:  # each non-empty range is read whole by one request
        assert start == stop or any(a <= start and stop <= b for a, b in merged)
    for a, b in merged:  # a chunk over the bound is a single range that is
        assert b - a <= max_chunk or (a, b) in ranges
    covered = sum(b - a for a, b in merged)
    assert covered <= sum(b - a for a, b in ranges) + gap * len(merged)


def test_transient_failures_are_retried_a_bounded_number_of_times(monkeypatch):
    from mmidx.io import storage

    monkeypatch.setattr(storage, "BACKOFF_S", 0.0)
    calls = []

    def flaky(failures, error):
        def call():
            calls.append(1)
            if len(calls) <= failures:
                raise error
            return "bytes"
        return call

    assert storage.retrying("s3://b/k", flaky(storage.RETRIES - 1, OSError("AWS Error SLOW_DOWN (503)"))) == "bytes"
    assert len(calls) == storage.RETRIES
    calls.clear()
    with pytest.raises(StorageError, match=r"^s3://b/k: storage request failed \(AWS Error SLOW_DOWN"):
        storage.retrying("s3://b/k", flaky(storage.RETRIES, OSError("AWS Error SLOW_DOWN (503)")))
    assert len(calls) == storage.RETRIES  # bounded: then one error naming the URI
    calls.clear()
    with pytest.raises(StorageError, match="access denied"):
        storage.retrying("s3://b/k", flaky(1, OSError("AWS Error ACCESS_DENIED during GetObject")))
    assert len(calls) == 1  # refused credentials are not retried


def test_build_inputs_in_s3_keep_their_query_options(s3, tmp_path, monkeypatch):
    from support.sources import build, write_jsonl

    from mmidx.sources.inputs import parent, resolve

    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"words {i} " * (i + 2)} for i in range(8)])
    s3.client.upload_file(path, "mmidx", "inputs/docs.jsonl")
    query = f"?endpoint_override={s3.endpoint}&scheme=http"
    assert parent(f"s3://mmidx/inputs/docs.jsonl{query}") == f"s3://mmidx/inputs{query}"
    assert resolve(f"s3://mmidx/inputs{query}", "a b.jpg") == f"s3://mmidx/inputs/a%20b.jpg{query}"
    local, _ = build("text", [path], tmp_path / "local")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")  # only the query reaches S3
    for source in (f"s3://mmidx/inputs/docs.jsonl{query}", f"s3://mmidx/inputs{query}"):  # a file, a folder
        remote, report = build("text", [source], tmp_path / f"from-s3-{len(source)}")
        assert report.ok and np.array_equal(remote.gather(np.arange(len(remote.tokens)))[0],
                                            local.gather(np.arange(len(local.tokens)))[0])


def test_a_build_to_s3_rerun_on_another_machine_reuses_the_shards_it_uploaded(s3, tmp_path, monkeypatch):
    import os
    import shutil

    from support.sources import build, write_jsonl

    from mmidx.ingest.remote import scratch_prefix
    from mmidx.io import storage

    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"document number {i} " * (i + 1)} for i in range(12)])
    size = os.path.getsize(path) // 3 + 1  # three units of JSONL byte ranges
    local, _ = build("text", [path], tmp_path / "local", bytes_per_shard=size)
    uri = "s3://mmidx/sharded/docs"

    def killed_at_the_dataset(source, target):
        if target.startswith(f"{uri}."):  # every shard is up; the machine dies uploading the dataset
            raise KeyboardInterrupt
        real_upload(source, target)

    real_upload = storage.upload
    monkeypatch.setattr(storage, "upload", killed_at_the_dataset)
    with pytest.raises(KeyboardInterrupt):
        build("text", [path], uri, bytes_per_shard=size)
    monkeypatch.setattr(storage, "upload", real_upload)
    shards = storage.list_objects(f"{uri}.shards")
    assert [name for name in shards if name.endswith("/report.json")] == [f"0000{i}/report.json" for i in range(3)]
    shutil.rmtree(scratch_prefix(uri).parent)  # another machine: no local scratch
    remote, report = build("text", [path], uri, bytes_per_shard=size)
    assert report.ok and report.data["reused_units"] == 3 and report.message.endswith(f"uploaded to {uri}")
    assert np.array_equal(remote.gather(np.arange(len(remote.tokens)))[0],
                          local.gather(np.arange(len(local.tokens)))[0])
    assert storage.list_objects(f"{uri}.shards") == []  # mirrored shards are gone once the dataset is up


SECRET_URI = "s3://AKIAEXAMPLE:wJalrXUtnFEMIsecret@mmidx/{}?endpoint_override=127.0.0.1:1&scheme=http"


@pytest.mark.parametrize("argv", [["inspect", "{uri}"], ["verify", "{uri}"], ["fetch", "{uri}", "-o", "{out}"],
                                  ["build", "--source", "text", "--input", "{uri}.jsonl", "--output", "{out}/x"],
                                  ["build", "--source", "text", "--input", "{local}", "--output", "{uri}"]])
def test_credentials_inside_a_uri_are_refused_in_one_line_that_never_shows_them(argv, tmp_path, capsys):
    from support.sources import tokenizer_dir, write_jsonl

    from mmidx.cli import main

    local = write_jsonl(tmp_path / "docs.jsonl", [{"text": "a few words"}])
    args = [part.format(uri=SECRET_URI.format("data/x"), out=tmp_path / "out", local=local) for part in argv]
    if argv[0] == "build":
        args += ["--tokenizer", tokenizer_dir(), "--quiet"]
    assert main(args) == 1
    captured = capsys.readouterr()
    error = captured.err.strip()
    assert len(error.splitlines()) == 1, error
    assert "credentials inside a URI are not accepted" in error and "AWS_ACCESS_KEY_ID" in error
    assert "wJalrXUtnFEMIsecret" not in captured.err + captured.out and "AKIAEXAMPLE" not in captured.err
    assert "s3://***@mmidx/data/x" in error
    assert not [path for path in tmp_path.glob("out*/**/*") if path.is_file()]  # nothing written


def test_a_dataset_opened_with_credentials_in_its_uri_is_refused_naming_what_to_do():
    with pytest.raises(StorageError, match="AWS_ACCESS_KEY_ID") as raised:
        MMIDXDataset(SECRET_URI.format("data/x"))
    assert "secret" not in str(raised.value)


def test_redact_hides_the_credentials_of_every_uri_in_a_message():
    from mmidx.io.storage import redact

    text = "copy s3://K:S@b/p to gs://user@bucket/q, keep s3://bucket/a@b and /local/x@y"
    assert redact(text) == "copy s3://***@b/p to gs://***@bucket/q, keep s3://bucket/a@b and /local/x@y"


@pytest.mark.parametrize("failures", [0, 1, 2])
def test_a_remote_jsonls_line_count_rides_out_throttled_requests(s3, failures):
    """shuffle_lines and num_used_data count the lines of the JSONL a vlm dataset was built from; in S3 the read
    is one stream, which pyarrow retries (RETRIES attempts): S3 answering 503 SlowDown to the first requests
    costs a retry, not the build."""
    from support.s3_faults import ThrottlingProxy

    from mmidx.config import GroupConfig
    from mmidx.index.subsets import line_count

    s3.client.put_object(Bucket="mmidx", Key="lines/vlm.jsonl",
                         Body=b"".join(b'{"n": %d}\n' % i for i in range(3000)) + b'{"last": true}')
    host, port = s3.endpoint.rsplit(":", 1)
    proxy = ThrottlingProxy((host, int(port)), failures)
    try:
        location = f"s3://mmidx/lines/vlm.jsonl?endpoint_override={proxy.endpoint}&scheme=http"
        assert line_count(location, GroupConfig("vlm", (location,))) == 3001  # the last line has no newline
        assert proxy.throttled == failures
    finally:
        proxy.stop()
