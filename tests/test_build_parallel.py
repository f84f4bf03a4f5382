"""Parallel builds equal serial ones; a killed build resumes from its finished shards to exactly the same dataset."""

import json
import time

import pyarrow as pa
import pytest
from support.build_cases import kill_after_first_shard
from support.sources import build, image_bytes, tokenizer_dir, write_parquet

import mmidx.ingest.merge
from mmidx.format import FormatError, file_path
from mmidx.read.dataset import MMIDXDataset

DATA_FILES = ("bin", "idx", "images", "plan")


def _t2i_file(path, rows, seed=0, row_group_size=4):
    images = [image_bytes(48, 40, "RGB", "PNG", seed=seed * 1000 + i) for i in range(rows)]
    captions = [json.dumps({"0": f"photo {seed} {i}", "1": f"a cat {i}"}) for i in range(rows)]
    return write_parquet(path, {"image": images, "captions": captions},
                         {"image": pa.binary(), "captions": pa.string()}, row_group_size)


def _same_files(a, b):
    return all(file_path(a, role).read_bytes() == file_path(b, role).read_bytes() for role in DATA_FILES)


def _crashing_merge(*args, **kwargs):
    raise OSError("disk full")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    return [_t2i_file(folder / "a.parquet", 24, seed=1), _t2i_file(folder / "b.parquet", 10, seed=2)]


@pytest.fixture(scope="module")
def serial(inputs, tmp_path_factory):
    dataset, report = build("t2i", inputs, tmp_path_factory.mktemp("serial") / "out", views=2, rows_per_shard=4)
    return dataset, report


def test_two_workers_write_byte_identical_files_to_one_worker(inputs, serial, tmp_path):
    parallel, report = build("t2i", inputs, tmp_path / "out", views=2, rows_per_shard=4, workers=2)
    assert report.data["units"] == 9 and len(parallel) == 34
    assert _same_files(parallel.prefix, serial[0].prefix)


def test_shards_are_merged_in_input_order(serial, inputs):
    dataset = serial[0]
    origins = [dataset[i].origin for i in range(len(dataset))]
    assert origins == [(inputs[0], r) for r in range(24)] + [(inputs[1], r) for r in range(10)]


def test_a_finished_build_is_not_rebuilt_and_leaves_no_shards(inputs, tmp_path):
    build("t2i", inputs, tmp_path / "out", rows_per_shard=4)
    assert not (tmp_path / "out.shards").exists()
    _, again = build("t2i", inputs, tmp_path / "out", rows_per_shard=4)
    assert again.message.startswith("already built")


def test_a_crash_in_the_merge_leaves_no_dataset_and_the_rerun_reuses_every_shard(inputs, serial, tmp_path,
                                                                                   monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(mmidx.ingest.merge, "merge_datasets", _crashing_merge)
        with pytest.raises(OSError, match="disk full"):
            build("t2i", inputs, tmp_path / "out", views=2, rows_per_shard=4)
    with pytest.raises(FormatError):
        MMIDXDataset(tmp_path / "out")
    dataset, report = build("t2i", inputs, tmp_path / "out", views=2, rows_per_shard=4)
    assert report.data["reused_units"] == report.data["units"] == 9
    assert _same_files(dataset.prefix, serial[0].prefix)


def test_shards_of_a_changed_input_are_rebuilt(inputs, tmp_path, monkeypatch):
    copies = [_t2i_file(tmp_path / "a.parquet", 24, seed=1), _t2i_file(tmp_path / "b.parquet", 10, seed=2)]
    with monkeypatch.context() as patch:
        patch.setattr(mmidx.ingest.merge, "merge_datasets", _crashing_merge)
        with pytest.raises(OSError, match="disk full"):
            build("t2i", copies, tmp_path / "out", rows_per_shard=4)
    time.sleep(0.01)
    _t2i_file(tmp_path / "b.parquet", 10, seed=3)
    dataset, report = build("t2i", copies, tmp_path / "out", rows_per_shard=4)
    assert report.data["reused_units"] == 6  # a.parquet's six units; b.parquet's three were rebuilt
    assert bytes(dataset[24].image(0).data) == image_bytes(48, 40, "RGB", "PNG", seed=3000)


def test_progress_shows_rows_images_and_tokens_per_second(inputs, tmp_path, capsys):
    from mmidx.ingest import BuildOptions, build_dataset
    from mmidx.sources import SourceOptions

    build_dataset(BuildOptions("t2i", tuple(inputs), tokenizer_dir(), str(tmp_path / "out"),
                               SourceOptions(rows_per_shard=4), workers=2))
    err = capsys.readouterr().err
    assert "34/34" in err and "rows/s" in err and "images/s" in err and "tokens/s" in err


def test_a_build_killed_mid_way_resumes_to_exactly_the_expected_samples(serial, inputs, tmp_path):
    finished = kill_after_first_shard(["build", "--source", "t2i", "--input", *inputs, "--tokenizer", tokenizer_dir(),
                                       "--output", str(tmp_path / "out"), "--views", "2", "--rows-per-shard", "1",
                                       "--workers", "2", "--quiet"], tmp_path / "out")
    assert 1 <= finished < 34, "the kill did not land mid-way"
    with pytest.raises(FormatError):
        MMIDXDataset(tmp_path / "out")
    dataset, report = build("t2i", inputs, tmp_path / "out", views=2, rows_per_shard=1, workers=2)
    assert report.ok and report.data["reused_units"] == finished
    assert report.data["rows"] == report.data["samples"] == len(dataset) == 34
    for i in range(len(dataset)):
        expected = serial[0][i]
        assert bytes(dataset[i].image(0).data) == bytes(expected.image(0).data)
        assert [t.tolist() for t in dataset[i].texts] == [t.tolist() for t in expected.texts]
        assert [dataset[i].sequence_plan(v) for v in range(2)] == [expected.sequence_plan(v) for v in range(2)]
