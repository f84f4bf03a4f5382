"""Ray Data: read_mmidx gives every sample once with its bytes; filter + write_mmidx equals mmidx build of the rows.

Runs on the session's one local Ray cluster (``cluster`` in conftest.py).
"""

import json
import os
import shutil

import datasets
import pytest
from support.build_cases import DATASET_FILES
from support.hf import save, t2i_dataset, t2i_features, t2i_rows
from support.sources import build, loaded_tokenizer, tokenizer_dir

from mmidx.format import file_path
from mmidx.io.storage import is_remote, list_objects, upload_dataset
from mmidx.read.dataset import MMIDXDataset

ray = pytest.importorskip("ray")
from mmidx.toolkit.ray_data import RayWriteError, read_mmidx, write_mmidx  # noqa: E402

VIEWS = 3
DATA_FILES = [role for role in DATASET_FILES if role != "meta"]


def same_data_files(a, b):
    """The bin, idx, images and plan files are byte-identical (the metadata records how each was made)."""
    return all(file_path(a, role).read_bytes() == file_path(b, role).read_bytes() for role in DATA_FILES)


@pytest.fixture(scope="module")
def rows():
    return t2i_rows(18)


@pytest.fixture(scope="module")
def built(rows, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ray-data")
    dataset, _ = build("hf", [save(t2i_dataset(rows), folder / "in")], folder / "out", views=VIEWS,
                       keep_columns=("score",))
    return dataset


def test_read_mmidx_gives_every_sample_once_with_its_bytes_texts_and_origin(cluster, built):
    ds = read_mmidx(built.prefix, override_num_blocks=4)
    assert ds.count() == len(built)
    got = sorted(ds.take_all(), key=lambda row: row["sample"])
    assert [row["sample"] for row in got] == list(range(len(built)))
    for row in got:
        sample = built[row["sample"]]
        assert row["images"] == [bytes(image.data) for image in sample.images]
        assert row["image_sizes"] == [[image.width, image.height] for image in sample.images]
        assert row["texts"] == [loaded_tokenizer().decode(text) for text in sample.texts]
        assert (row["origin_file"], row["origin_row"]) == sample.origin
        assert json.loads(row["extra"]) == sample.extra and row["dataset"] == built.prefix


def test_read_mmidx_reads_only_the_columns_asked_for_and_every_dataset_of_a_data_yaml(cluster, built, tmp_path):
    yaml = tmp_path / "data.yaml"
    yaml.write_text(f"groups:\n  a: {{datasets: [{built.prefix}]}}\n  b: {{datasets: [{built.prefix}]}}\n")
    ds = read_mmidx(str(yaml), columns=["sample", "tokens"])
    assert ds.columns() == ["sample", "tokens"]
    rows = sorted(ds.take_all(), key=lambda row: row["sample"])
    assert len(rows) == len(built)  # one dataset named by two groups is read once
    assert [row["tokens"] for row in rows] == [[text.tolist() for text in built[i].texts] for i in range(len(built))]


def test_a_filter_and_write_mmidx_equals_mmidx_build_of_the_same_rows(cluster, rows, tmp_path):
    t2i_dataset(rows).to_parquet(str(tmp_path / "hf.parquet"))
    ds = ray.data.read_parquet(str(tmp_path / "hf.parquet")).filter(lambda row: row["score"] % 2 != 1)
    report = write_mmidx(ds.repartition(3), tmp_path / "ray" / "out", tokenizer_dir(), views=VIEWS,
                         keep_columns=("score",), source_name="rows.parquet")
    kept = [row for row in rows if row["score"] % 2 != 1]
    assert report.ok and report.data["samples"] == len(kept) < len(rows) and report.data["units"] == 3
    datasets.Dataset.from_list(kept, features=t2i_features()).to_parquet(str(tmp_path / "build" / "rows.parquet"))
    build("hf", [tmp_path / "build" / "rows.parquet"], tmp_path / "build" / "out", views=VIEWS,
          keep_columns=("score",))
    assert same_data_files(tmp_path / "ray" / "out", tmp_path / "build" / "out")
    assert not (tmp_path / "ray" / "out.ray-shards").exists()


def test_read_mmidx_filter_write_mmidx_equals_mmidx_build_of_the_filtered_rows(cluster, built, rows, tmp_path):
    ds = read_mmidx(built.prefix, override_num_blocks=3).filter(lambda row: row["image_sizes"][0][0] >= 40)
    write_mmidx(ds, tmp_path / "ray" / "out", tokenizer_dir(), views=VIEWS, caption_columns=("texts",),
                source_name="rows.parquet")
    kept = [row for row in rows if datasets.Image().decode_example(row["image"]).width >= 40]
    features = datasets.Features({"images": datasets.List(datasets.Value("binary")),
                                  "texts": datasets.List(datasets.Value("string"))})
    same_rows = [{"images": [row["image"]["bytes"]], "texts": row["captions"] or [" "]} for row in kept]
    datasets.Dataset.from_list(same_rows, features=features).to_parquet(str(tmp_path / "build" / "rows.parquet"))
    build("hf", [tmp_path / "build" / "rows.parquet"], tmp_path / "build" / "out", views=VIEWS,
          caption_columns=("texts",))
    assert same_data_files(tmp_path / "ray" / "out", tmp_path / "build" / "out")


def test_rows_that_cannot_be_built_are_counted_with_their_row_in_the_dataset(cluster, rows, tmp_path):
    broken = [{**row, "image": {"bytes": b"not an image", "path": None}} if i == 4 else row
              for i, row in enumerate(rows[:6])]
    t2i_dataset(broken).to_parquet(str(tmp_path / "hf.parquet"))
    ds = ray.data.read_parquet(str(tmp_path / "hf.parquet")).repartition(2)
    report = write_mmidx(ds, tmp_path / "out", tokenizer_dir(), max_skip_rate=0.5)
    skips = report.data["skips"]
    assert report.data["samples"] == 5 and list(skips) == ["undecodable_image"]
    assert skips["undecodable_image"]["examples"][0]["row"] == 4


def test_read_mmidx_reads_a_dataset_in_object_storage(cluster, built, s3):
    uri = s3.upload(built.prefix, "s3://mmidx/ray/out")
    settings = {name: os.environ[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                                    "AWS_ENDPOINT_URL", "MMIDX_CACHE_DIR")}
    ds = read_mmidx(uri, columns=["sample", "images"], ray_remote_args={"runtime_env": {"env_vars": settings}})
    rows = sorted(ds.take_all(), key=lambda row: row["sample"])
    assert [row["images"] for row in rows] == [[bytes(image.data) for image in built[i].images]
                                               for i in range(len(built))]


def s3_task_settings():
    """The S3 server's settings for Ray tasks, whose workers started before the ``s3`` fixture set them."""
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "MMIDX_CACHE_DIR")
    return {"runtime_env": {"env_vars": {name: os.environ[name] for name in names}}}


def test_write_mmidx_onto_a_dataset_in_object_storage_refuses_and_replaces_it_only_with_overwrite(
        cluster, rows, s3, tmp_path):
    for count in (8, 5):
        t2i_dataset(rows[:count]).to_parquet(str(tmp_path / f"{count}.parquet"))
    uri, remote = "s3://mmidx/ray-write/out", s3_task_settings()
    write_mmidx(ray.data.read_parquet(str(tmp_path / "8.parquet")), uri, tokenizer_dir(), ray_remote_args=remote)
    meta = s3.client.get_object(Bucket="mmidx", Key="ray-write/out.meta.json")["Body"].read()
    with pytest.raises(RayWriteError, match=r"s3://mmidx/ray-write/out: a dataset is there already \(.*out\.idx.*\); "
                                            r"pass overwrite=True to replace it"):
        write_mmidx(ray.data.read_parquet(str(tmp_path / "5.parquet")), uri, tokenizer_dir(), ray_remote_args=remote)
    assert s3.client.get_object(Bucket="mmidx", Key="ray-write/out.meta.json")["Body"].read() == meta
    assert len(MMIDXDataset(uri)) == 8
    report = write_mmidx(ray.data.read_parquet(str(tmp_path / "5.parquet")), uri, tokenizer_dir(),
                         ray_remote_args=remote, overwrite=True)
    assert report.ok and len(MMIDXDataset(uri)) == 5


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_dataset_written_at_the_prefix_while_write_mmidx_runs_is_not_replaced(cluster, rows, built, s3, tmp_path,
                                                                                where):
    """Another writer puts a dataset at the prefix after the job's start check (here, from inside the job's own
    tasks): the commit checks again, refuses, and leaves that dataset whole; the staged shards are removed."""
    prefix = "s3://mmidx/ray-race/out" if where == "s3" else str(tmp_path / "out")
    intruder = built.prefix

    def write_another_dataset_there(batch):
        if is_remote(prefix):
            upload_dataset(intruder, prefix)  # the same dataset again is no upload: once, whatever the batches
        else:
            for role in DATASET_FILES:
                if not file_path(prefix, role).exists():
                    shutil.copyfile(file_path(intruder, role), file_path(prefix, role))
        return batch

    t2i_dataset(rows[:6]).to_parquet(str(tmp_path / "rows.parquet"))
    ds = ray.data.read_parquet(str(tmp_path / "rows.parquet")).map_batches(
        write_another_dataset_there, batch_format="pyarrow", **s3_task_settings())
    with pytest.raises(RayWriteError, match=r"a dataset is there now, written while this job ran .*overwrite=True"):
        write_mmidx(ds, prefix, tokenizer_dir(), ray_remote_args=s3_task_settings())
    assert len(MMIDXDataset(prefix)) == len(built)
    assert MMIDXDataset(prefix).metadata["meta_sha256"] == built.metadata["meta_sha256"]
    if where == "s3":
        assert list_objects(prefix + ".ray-shards") == []
    else:
        assert not os.path.exists(prefix + ".ray-shards")
