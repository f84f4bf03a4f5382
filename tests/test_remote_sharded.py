"""Sharded datasets in object storage (moto's S3 server on 127.0.0.1): a build to s3:// that ends sharded keeps the
shards it uploaded and adds only its table and metadata; a sharded dataset uploads, opens, reads and fetches with
its shards, URI query options kept on every shard; a missing shard is one error naming it."""

import os

import numpy as np
import pytest
from support.sources import build, tokenizer_dir, write_jsonl

from mmidx.io import storage
from mmidx.io.storage import StorageError, fetch_dataset, shard_location, upload_dataset
from mmidx.read.dataset import MMIDXDataset
from mmidx.toolkit.scale_data import write_synthetic


def samples_of(dataset):
    """Every sample's texts and image bytes, comparable with ==."""
    return [([t.tolist() for t in s.texts], [bytes(image.data) for image in s.images])
            for s in (dataset[i] for i in range(len(dataset)))]


def build_sharded(inputs, output):
    """A text build that ends sharded (``--layout sharded``); the opened dataset and the report."""
    from mmidx.ingest import BuildOptions, build_dataset
    from mmidx.sources import SourceOptions

    report = build_dataset(BuildOptions("text", tuple(map(str, inputs)), tokenizer_dir(), output, SourceOptions(),
                                        max_skip_rate=1.0, progress=False, layout="sharded"))
    return MMIDXDataset(output), report


def documents(dataset):
    return [[t.tolist() for t in dataset[i].texts] for i in range(len(dataset))]


def test_a_build_to_s3_that_ends_sharded_keeps_its_shards_and_opens_with_the_local_samples(s3, tmp_path):
    paths = [write_jsonl(tmp_path / f"docs{k}.jsonl", [{"text": f"doc {k} number {i} " * (i + 1)} for i in range(5)])
             for k in range(3)]
    local, _ = build("text", paths, tmp_path / "local")
    uri = "s3://mmidx/sharded-build/docs"
    remote, report = build_sharded(paths, uri)
    assert report.ok and report.data["layout"] == "sharded" and report.message.endswith(f"uploaded to {uri}")
    assert remote.is_sharded and len(remote.parts) == 3
    assert documents(remote) == documents(local)
    names = storage.list_objects("s3://mmidx/sharded-build")
    assert {"docs.meta.json", "docs.shards.table"} <= set(names)
    assert {f"docs.shards/0000{k}/shard.meta.json" for k in range(3)} <= set(names)
    _, again = build_sharded(paths, uri)
    assert again.message.endswith(f"already at {uri}")
    assert documents(MMIDXDataset(uri)) == documents(local)


def test_a_sharded_dataset_uploads_opens_and_fetches_with_its_shards_and_query_options(s3, tmp_path):
    local = write_synthetic(tmp_path / "t2i", 40, shards=4)
    host, port = s3.endpoint.split(":")
    uri = f"s3://mmidx/sharded-upload/t2i?endpoint_override={host}:{port}&scheme=http"
    assert shard_location(uri, 3) == \
        f"s3://mmidx/sharded-upload/t2i.shards/00003/shard?endpoint_override={host}:{port}&scheme=http"
    saved = os.environ.pop("AWS_ENDPOINT_URL")  # only the query says where the store is
    try:
        assert upload_dataset(local, uri)
        assert not upload_dataset(local, uri)  # the same dataset is there
        remote = MMIDXDataset(uri)
        assert remote.is_sharded and samples_of(remote) == samples_of(MMIDXDataset(local))
        fetched = fetch_dataset(uri, tmp_path / "fetched")
    finally:
        os.environ["AWS_ENDPOINT_URL"] = saved
    assert MMIDXDataset(fetched).is_sharded and samples_of(MMIDXDataset(fetched)) == samples_of(MMIDXDataset(local))


def test_a_missing_remote_shard_is_one_error_naming_it(s3, tmp_path):
    local = write_synthetic(tmp_path / "t2i", 30, shards=3)
    uri = "s3://mmidx/sharded-missing/t2i"
    upload_dataset(local, uri)
    s3.client.delete_object(Bucket="mmidx", Key="sharded-missing/t2i.shards/00002/shard.meta.json")
    remote = MMIDXDataset(uri, cache_dir=tmp_path / "fresh-cache")
    assert np.array_equal(remote[0].texts[0], MMIDXDataset(local)[0].texts[0])
    with pytest.raises(StorageError, match=r"t2i\.shards/00002/shard\.meta\.json"):
        remote[len(remote) - 1]


def test_a_sharded_rebuild_of_fewer_units_deletes_the_remote_shards_its_table_does_not_name(s3, tmp_path):
    from mmidx.ingest import BuildOptions, build_dataset
    from mmidx.sources import SourceOptions

    paths = [write_jsonl(tmp_path / f"docs{k}.jsonl", [{"text": f"doc {k} row {i} " * (i + 2)} for i in range(4)])
             for k in range(3)]
    uri = "s3://mmidx/sharded-rebuild/docs"
    build_sharded(paths, uri)
    report = build_dataset(BuildOptions("text", tuple(map(str, paths[:2])), tokenizer_dir(), uri, SourceOptions(),
                                        max_skip_rate=1.0, progress=False, layout="sharded", force=True))
    assert report.ok
    folders = {name.split("/")[1] for name in storage.list_objects("s3://mmidx/sharded-rebuild")
               if name.startswith("docs.shards/")}
    assert folders == {"00000", "00001"}
    assert len(MMIDXDataset(uri)) == 8
