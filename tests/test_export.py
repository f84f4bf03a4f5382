"""mmidx export: build → export → build again gives the same samples, and what cannot round-trip is counted."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.cases import CAPTIONS, CASES, FILES, IMAGES
from support.sources import (
    build,
    image_bytes,
    loaded_tokenizer,
    texts_of,
    write_jsonl,
    write_parquet,
    write_t2i_parquet,
    write_tar,
)

from mmidx.cli import main
from mmidx.toolkit.export import export

VIEWS = 3


def encode_text(dataset, index):
    """Text j of sample ``index`` decoded with the test tokenizer."""
    return lambda j: loaded_tokenizer().decode(dataset[index].text(j))


def assert_same_samples(original, rebuilt):
    """Texts, image bytes and probed info, every view's element records, extra JSON and rows are equal."""
    assert len(rebuilt) == len(original)
    for index in range(len(original)):
        a, b = original[index], rebuilt[index]
        assert texts_of(b) == texts_of(a), index
        assert [bytes(image.data) for image in b.images] == [bytes(image.data) for image in a.images], index
        assert [image[1:] for image in b.images] == [image[1:] for image in a.images], index
        assert b.num_views == a.num_views
        for view in range(a.num_views):
            assert b.elements(view).tobytes() == a.elements(view).tobytes(), (index, view)
        assert b.extra == a.extra and b.origin[1] == a.origin[1]


@pytest.fixture(scope="module")
def t2i(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t2i")
    images = [image_bytes(w, h, mode, fmt, seed=i) for i, (w, h, mode, fmt) in enumerate(IMAGES)]
    path = write_t2i_parquet(folder / "part.parquet", images, CAPTIONS, row_group_size=3)
    dataset, _ = build("t2i", [path], folder / "out", views=VIEWS)
    return dataset


def test_t2i_parquet_round_trips(t2i, tmp_path):
    report = export(t2i.prefix, "parquet", tmp_path / "export")
    assert report.samples == len(t2i) and report.lossy == {}
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["part.parquet"]
    rebuilt, _ = build("t2i", [tmp_path / "export"], tmp_path / "again", views=VIEWS)
    assert_same_samples(t2i, rebuilt)


def test_t2i_to_webdataset_keeps_texts_and_images_and_says_captions_are_drawn_anew(t2i, tmp_path):
    report = export(t2i.prefix, "wds", tmp_path / "export")
    assert report.lossy == {"the file name changes, so each view's caption is drawn anew": len(t2i),
                            "more than two captions (a wds sample carries two)": 2}
    rebuilt, _ = build("wds", [tmp_path / "export"], tmp_path / "again", views=VIEWS)
    for index in range(len(t2i)):
        kept = texts_of(t2i[index])[:2]
        assert texts_of(rebuilt[index]) == kept
        assert bytes(rebuilt[index].image(0).data) == bytes(t2i[index].image(0).data)


def test_webdataset_round_trips(tmp_path):
    members = []
    for row, caption in enumerate(["a red car", "blue sky", "", "tree house"]):
        members.append((f"{row:05d}.jpg", image_bytes(32, 24, seed=row)))
        members.append((f"{row:05d}.txt", caption.encode()))
        if row % 2:
            members.append((f"{row:05d}.json", json.dumps({"caption": f"second {row}"}).encode()))
    original, _ = build("wds", [write_tar(tmp_path / "shard.tar", members)], tmp_path / "out", views=VIEWS)
    assert export(original.prefix, "wds", tmp_path / "export").lossy == {}
    rebuilt, _ = build("wds", [tmp_path / "export"], tmp_path / "again", views=VIEWS)
    assert_same_samples(original, rebuilt)


def test_llava_jsonl_round_trips_every_conversation_shape(tmp_path):
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    path = write_jsonl(tmp_path / "sft.jsonl", [row for row, _ in CASES])
    original, _ = build("vlm", [path], tmp_path / "out", image_root=str(tmp_path))
    report = export(original.prefix, "jsonl", tmp_path / "export")
    assert report.lossy == {} and report.images == sum(o.num_images for o in map(original.__getitem__,
                                                                                  range(len(original))))
    rebuilt, _ = build("vlm", [tmp_path / "export" / "sft.jsonl"], tmp_path / "again")
    assert_same_samples(original, rebuilt)


def _edit_rows(tmp_path, instruction_lists):
    images = [[image_bytes(32, 32, seed=10 * row + k) for k in range(len(steps) + 1)]
              for row, steps in enumerate(instruction_lists)]
    return write_parquet(tmp_path / "edit.parquet", {"image_list": images, "instruction_list": instruction_lists},
                         {"image_list": pa.list_(pa.binary()), "instruction_list": pa.list_(pa.list_(pa.string()))},
                         row_group_size=2)


def test_edit_with_one_instruction_per_step_and_two_images_round_trips(tmp_path):
    path = _edit_rows(tmp_path, [[["make it red"]], [["add a hat"]], [["remove the tree"]]])
    original, _ = build("edit", [path], tmp_path / "out", views=VIEWS)
    report = export(original.prefix, "parquet", tmp_path / "export")
    assert report.lossy == {}
    info = json.loads((tmp_path / "export" / "parquet_info.json").read_text())
    assert list(info) == [str((tmp_path / "export" / "edit.parquet").resolve())]
    rebuilt, _ = build("edit", [tmp_path / "export" / "edit.parquet"], tmp_path / "again", views=VIEWS)
    assert_same_samples(original, rebuilt)


def test_edit_instructions_are_recovered_from_sequential_and_combined_draws(tmp_path):
    rows = [[["make it red."], ["add a hat"], ["remove the tree."]], [["paint it blue"], ["crop it."]],
            [["zoom in"], ["zoom out"], ["rotate"], ["flip."]]]
    original, _ = build("edit", [_edit_rows(tmp_path, rows)], tmp_path / "out", views=16)
    drawn = {text for i in range(len(original)) for text in map(encode_text(original, i), range(original[i].num_texts))}
    assert drawn & {option + "." for row in rows for step in row for option in step}  # one-step combined draws
    assert any(". " in text for text in drawn)  # and a combined draw over several steps
    report = export(original.prefix, "parquet", tmp_path / "export")
    assert report.lossy == {}
    assert pq.read_table(tmp_path / "export" / "edit.parquet").column("instruction_list").to_pylist() == rows
    rebuilt, _ = build("edit", [tmp_path / "export" / "edit.parquet"], tmp_path / "again", views=16)
    assert_same_samples(original, rebuilt)


def test_edit_with_several_instructions_keeps_the_drawn_ones_and_counts_the_rows(tmp_path):
    steps = [["make it red", "paint it red", "red please"], ["add a hat", "put on a hat"]]
    original, _ = build("edit", [_edit_rows(tmp_path, [steps])], tmp_path / "out", views=8)
    report = export(original.prefix, "parquet", tmp_path / "export")
    assert report.lossy == {"a step has several instructions, so the rebuild draws anew": 1}
    row = pq.read_table(tmp_path / "export" / "edit.parquet").to_pylist()[0]
    assert row["image_list"] == [bytes(image.data) for image in original[0].images]
    assert all(options and set(options) <= set(steps[k]) for k, options in enumerate(row["instruction_list"]))


def test_export_names_its_folder_with_output_and_the_old_last_argument_still_works_with_a_warning(t2i, tmp_path,
                                                                                                  capsys):
    assert main(["export", t2i.prefix, "--to", "parquet", "--output", str(tmp_path / "new")]) == 0
    assert capsys.readouterr().err == ""
    assert main(["export", t2i.prefix, "--to", "parquet", str(tmp_path / "old")]) == 0
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith("mmidx export: warning: the folder as a last argument") and \
        warning.endswith(f"-o/--output {tmp_path / 'old'}")
    assert sorted(path.name for path in (tmp_path / "old").iterdir()) == sorted(
        path.name for path in (tmp_path / "new").iterdir())


def test_export_refuses_a_used_folder_and_a_layout_the_source_has_not(t2i, tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    assert main(["export", t2i.prefix, "--to", "parquet", "-o", str(tmp_path / "used")]) == 1
    assert main(["export", t2i.prefix, "--to", "jsonl", "-o", str(tmp_path / "new")]) == 1
    err = capsys.readouterr().err
    assert "not an empty folder" in err and "exports --to parquet or wds" in err and "Traceback" not in err
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.partial").exists()
