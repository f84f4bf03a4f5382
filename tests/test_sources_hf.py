"""hf: Hugging Face datasets (made with ``datasets`` itself) in and out — the t2i and vlm sources are the oracles."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.build_cases import DATASET_FILES
from support.hf import conversation_dataset, save, t2i_dataset, t2i_rows
from support.sources import build, encode, texts_of, tokenizer_dir, write_jsonl, write_t2i_parquet

from mmidx.cli import main
from mmidx.errors import MMIDXError
from mmidx.format import file_path
from mmidx.toolkit.export_hf import export_hf

VIEWS = 3
DATA_FILES = [role for role in DATASET_FILES if role != "meta"]


def same_data_files(a, b):
    """The bin, idx, images and plan files are byte-identical (the metadata records the input paths)."""
    return all(file_path(a, role).read_bytes() == file_path(b, role).read_bytes() for role in DATA_FILES)


def meta_without_inputs(prefix):
    meta = json.loads(file_path(prefix, "meta").read_text())
    meta["build"].pop("inputs")
    meta.pop("sources")
    meta.pop("meta_sha256", None)
    return meta


@pytest.fixture(scope="module")
def rows():
    return t2i_rows()


@pytest.fixture(scope="module")
def saved(rows, tmp_path_factory):
    """An HF dataset saved with save_to_disk, built with --source hf."""
    folder = tmp_path_factory.mktemp("hf")
    dataset, report = build("hf", [save(t2i_dataset(rows), folder / "in")], folder / "out", views=VIEWS,
                            keep_columns=("score",))
    return dataset, report, folder


def test_a_saved_dataset_builds_one_sample_per_row_with_the_original_image_bytes(saved, rows):
    dataset, report, folder = saved
    assert report.ok and len(dataset) == len(rows)
    for index, row in enumerate(rows):
        sample = dataset[index]
        assert bytes(sample.image(0).data) == row["image"]["bytes"]
        assert sorted(texts_of(sample)) == sorted(encode(text) for text in row["captions"] or [" "])
        assert sample.origin == (str(folder / "in" / "data-00000-of-00001.arrow"), index)
        assert sample.extra == {"score": row["score"]}


def test_t2i_rows_build_exactly_as_the_t2i_source_builds_the_same_rows_in_bagels_parquet(rows, tmp_path):
    name = "train-00000-of-00001.parquet"  # the same file name: the same draws
    t2i_dataset(rows).to_parquet(str(tmp_path / "hub" / "data" / name))
    build("hf", [tmp_path / "hub"], tmp_path / "hf", views=VIEWS, rows_per_shard=2)
    (tmp_path / "bagel").mkdir()
    bagel = write_t2i_parquet(tmp_path / "bagel" / name, [row["image"]["bytes"] for row in rows],
                              [{str(k): text for k, text in enumerate(row["captions"])} for row in rows], 2)
    build("t2i", [bagel], tmp_path / "t2i", views=VIEWS)
    assert same_data_files(tmp_path / "hf", tmp_path / "t2i")


def test_export_to_hf_is_what_load_from_disk_opens_with_the_same_rows(saved, rows):
    dataset, _, folder = saved
    report = export_hf(dataset.prefix, folder / "export")
    assert report.samples == len(rows) and report.lossy == {}
    loaded = datasets.load_from_disk(str(folder / "export"))
    assert isinstance(loaded.features["image"], datasets.Image)
    loaded = loaded.cast_column("image", datasets.Image(decode=False))
    assert len(loaded) == len(rows)
    for index, (got, row) in enumerate(zip(loaded, rows, strict=True)):
        assert got["image"]["bytes"] == row["image"]["bytes"]
        assert got["captions"] == (row["captions"] or [" "])  # BAGEL's rule: no caption is the caption " "
        assert got["score"] == row["score"]
        assert (got["origin_file"], got["origin_row"]) == dataset[index].origin


def test_hf_to_mmidx_to_hf_to_mmidx_writes_the_same_files(saved, tmp_path):
    dataset = saved[0]
    assert main(["export", "--to", "hf", dataset.prefix, "-o", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "data-00000-of-00001.arrow").exists()
    again, _ = build("hf", [tmp_path / "export"], tmp_path / "out", views=VIEWS, keep_columns=("score",))
    assert same_data_files(dataset.prefix, again.prefix)
    assert meta_without_inputs(dataset.prefix) == meta_without_inputs(again.prefix)


def test_a_dataset_saved_in_several_shards_exports_one_arrow_file_per_shard_and_rebuilds_the_same(rows, tmp_path):
    t2i_dataset(rows).save_to_disk(str(tmp_path / "in"), num_shards=2)
    original, _ = build("hf", [tmp_path / "in"], tmp_path / "first" / "out", views=VIEWS)
    report = export_hf(original.prefix, tmp_path / "export")
    assert report.lossy == {}
    assert sorted(path.name for path in (tmp_path / "export").glob("*.arrow")) == [
        "data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert len(datasets.load_from_disk(str(tmp_path / "export"))) == len(rows)
    build("hf", [tmp_path / "export"], tmp_path / "again" / "out", views=VIEWS)
    assert same_data_files(original.prefix, tmp_path / "again" / "out")


def test_a_bagel_t2i_dataset_exports_to_hf_and_says_its_draws_change_with_the_file_name(rows, tmp_path):
    path = write_t2i_parquet(tmp_path / "part.parquet", [row["image"]["bytes"] for row in rows],
                             [{str(k): text for k, text in enumerate(row["captions"])} for row in rows], 3)
    original, _ = build("t2i", [path], tmp_path / "out", views=VIEWS)
    report = export_hf(original.prefix, tmp_path / "export")
    assert report.lossy == {"the file name changes, so each view's caption is drawn anew": len(rows)}
    again, _ = build("hf", [tmp_path / "export"], tmp_path / "again", views=VIEWS)
    for index in range(len(rows)):
        assert texts_of(again[index]) == texts_of(original[index])
        assert bytes(again[index].image(0).data) == bytes(original[index].image(0).data)


def test_conversation_rows_build_exactly_as_the_vlm_source_builds_the_same_llava_jsonl(tmp_path):
    conversations = conversation_dataset()
    build("hf", [save(conversations, tmp_path / "hf")], tmp_path / "from-hf")
    records = []
    for row, item in enumerate(conversations.cast_column("images", datasets.List(datasets.Image(decode=False)))):
        names = []
        for j, image in enumerate(item["images"]):
            (tmp_path / "jsonl" / f"{row}-{j}.img").parent.mkdir(exist_ok=True)
            (tmp_path / "jsonl" / f"{row}-{j}.img").write_bytes(image["bytes"])
            names.append(f"{row}-{j}.img")
        records.append({"conversations": item["conversations"], **({"image": names} if names else {})})
    build("vlm", [write_jsonl(tmp_path / "jsonl" / "rows.jsonl", records)], tmp_path / "from-vlm")
    assert same_data_files(tmp_path / "from-hf", tmp_path / "from-vlm")


def test_conversation_rows_round_trip_through_export_to_hf(tmp_path):
    original, _ = build("hf", [save(conversation_dataset(), tmp_path / "hf")], tmp_path / "out")
    export_hf(original.prefix, tmp_path / "export")
    loaded = datasets.load_from_disk(str(tmp_path / "export"))
    assert [len(row["images"]) for row in loaded] == [2, 1, 0]
    build("hf", [tmp_path / "export"], tmp_path / "again")
    assert same_data_files(original.prefix, tmp_path / "again")


def test_split_picks_one_split_of_a_dataset_dict(rows, tmp_path, capsys):
    splits = datasets.DatasetDict({"train": t2i_dataset(rows[:4]), "test": t2i_dataset(rows[4:])})
    save(splits, tmp_path / "dd")
    command = ["build", "--source", "hf", "--input", str(tmp_path / "dd"), "--tokenizer", tokenizer_dir(), "--quiet"]
    assert main([*command, "--output", str(tmp_path / "all")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"mmidx build: {tmp_path / 'dd'} holds the splits ['train', 'test']: choose one with --split"]
    assert main([*command, "--output", str(tmp_path / "test"), "--split", "test"]) == 0
    dataset, _ = build("hf", [tmp_path / "dd"], tmp_path / "test-again", split="test")
    assert [bytes(dataset[i].image(0).data) for i in range(len(dataset))] == [row["image"]["bytes"]
                                                                                 for row in rows[4:]]


def test_split_keeps_the_hub_layouts_files_of_that_split(rows, tmp_path):
    t2i_dataset(rows[:4]).to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))
    t2i_dataset(rows[4:]).to_parquet(str(tmp_path / "data" / "test-00000-of-00001.parquet"))
    dataset, _ = build("hf", [tmp_path], tmp_path / "out", split="train")
    assert len(dataset) == 4 and bytes(dataset[3].image(0).data) == rows[3]["image"]["bytes"]


def test_caption_columns_are_joined_in_order_into_the_caption_dict(rows, tmp_path):
    dataset, _ = build("hf", [save(t2i_dataset(rows), tmp_path / "in")], tmp_path / "out",
                       caption_columns=("caption", "captions"))
    for index, row in enumerate(rows):
        expected = dict.fromkeys([row["caption"], *row["captions"]])
        assert sorted(texts_of(dataset[index])) == sorted(encode(text) for text in expected)


def test_an_image_stored_as_a_path_is_read_from_the_tables_folder(rows, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "cat.img").write_bytes(rows[0]["image"]["bytes"])
    image = pa.array([{"bytes": None, "path": "cat.img"}], pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.table({"image": image, "caption": ["a cat"]}), tmp_path / "in" / "rows.parquet")
    dataset, report = build("hf", [tmp_path / "in" / "rows.parquet"], tmp_path / "out")
    assert report.ok and bytes(dataset[0].image(0).data) == rows[0]["image"]["bytes"]


def test_undecodable_images_and_bad_captions_are_counted_skips(rows, tmp_path):
    bad = [rows[0], {**rows[1], "captions": None}, {**rows[2], "image": {"bytes": b"not an image", "path": None}}]
    dataset, report = build("hf", [save(t2i_dataset(bad), tmp_path / "in")], tmp_path / "out")
    assert len(dataset) == 1
    assert {reason: entry["count"] for reason, entry in report.data["skips"].items()} == {
        "bad_captions": 1, "undecodable_image": 1}


def test_a_missing_column_is_one_line_naming_the_option(rows, tmp_path, capsys):
    folder = save(t2i_dataset(rows), tmp_path / "in")
    assert main(["build", "--source", "hf", "--input", folder, "--tokenizer", tokenizer_dir(), "--quiet", "--output",
                 str(tmp_path / "out"), "--caption-column", "alt_text"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no caption column ['alt_text']" in err and "--caption-column" in err


def test_keep_columns_refuses_a_column_that_is_not_json(rows, tmp_path):
    with pytest.raises(MMIDXError, match=r"'image' holds struct.*not JSON values"):
        build("hf", [save(t2i_dataset(rows), tmp_path / "in")], tmp_path / "out", keep_columns=("image",))

