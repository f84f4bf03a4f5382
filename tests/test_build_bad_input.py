"""Every class of bad input is skipped, counted under its reason with examples, and the rest is built intact."""

import json
import struct
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.sources import build, encode, image_bytes, texts_of, tokenizer_dir, write_jsonl, write_parquet

from mmidx import cli

T2I_TYPES = {"image": pa.binary(), "captions": pa.string()}


def _t2i(folder, images, captions, row_group_size=100):
    return write_parquet(folder / "t2i.parquet", {"image": images, "captions": captions}, T2I_TYPES, row_group_size)


def _good_images(count):
    return [image_bytes(32, 24, seed=i) for i in range(count)]


def _png_claiming(width, height):
    """A valid small PNG whose header claims width × height (a decompression bomb's header)."""
    data = bytearray(image_bytes(8, 8, "RGB", "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _assert_skipped(report, reason, rows, path, lines=None):
    """``rows`` skipped; JSONL inputs report them by ``lines``, 1-based, as editors number lines."""
    entry = report.data["skips"][reason]
    assert entry["count"] == len(rows)
    if lines is None:
        assert [(e["file"], e["row"]) for e in entry["examples"]] == [(str(path), row) for row in rows[:5]]
    else:
        assert [(e["file"], e["line"]) for e in entry["examples"]] == [(str(path), line) for line in lines[:5]]
    assert all(e["detail"] for e in entry["examples"])
    assert report.data["skipped"] == len(rows)


def _t2i_case(tmp_path, column, bad_rows, value, **options):
    """Six good t2i rows with ``column`` replaced by ``value`` in ``bad_rows``; checks the good rows."""
    images, captions = _good_images(6), [json.dumps({"0": f"caption {i}"}) for i in range(6)]
    for row in bad_rows:
        (images if column == "image" else captions)[row] = value
    path = _t2i(tmp_path, images, captions)
    dataset, report = build("t2i", [path], tmp_path / "out", views=1, **options)
    good = [row for row in range(6) if row not in bad_rows]
    assert [dataset[i].origin[1] for i in range(len(dataset))] == good
    for i, row in enumerate(good):
        assert bytes(dataset[i].image(0).data) == images[row] and texts_of(dataset[i]) == [encode(f"caption {row}")]
    return report, path


def _details(report, reason):
    return [example["detail"] for example in report.data["skips"][reason]["examples"]]


def test_undecodable_image_bytes(tmp_path):
    report, path = _t2i_case(tmp_path, "image", [1, 4], b"this is not an image")
    _assert_skipped(report, "undecodable_image", [1, 4], path)
    assert _details(report, "undecodable_image") == ["not a readable image (20 bytes starting b'this is '): not an "
                                                     "image format PIL recognises"] * 2  # no <_io.BytesIO at 0x…>


@pytest.mark.parametrize(("column", "reason", "detail"), [("image", "malformed_record", "image is null"),
                                                          ("captions", "bad_captions", "captions are null")])
def test_a_null_cell_is_called_null(tmp_path, column, reason, detail):
    report, path = _t2i_case(tmp_path, column, [2], None)
    _assert_skipped(report, reason, [2], path)
    assert _details(report, reason) == [detail]


@pytest.mark.parametrize("kind", ["JPEG", "PNG"])
def test_truncated_image(tmp_path, kind):
    whole = image_bytes(64, 64, "RGB", kind, seed=9)
    report, path = _t2i_case(tmp_path, "image", [2], whole[: len(whole) * 2 // 3])
    _assert_skipped(report, "undecodable_image", [2], path)


def test_decompression_bomb_beyond_pil_limit(tmp_path):
    report, path = _t2i_case(tmp_path, "image", [0], _png_claiming(60_000, 60_000), max_image_pixels=1000)
    _assert_skipped(report, "decompression_bomb", [0], path)
    assert _details(report, "decompression_bomb") == ["image of 3,600,000,000 pixels, above --max-image-pixels 1,000"]


def test_decompression_bomb_beyond_max_image_pixels(tmp_path):
    report, path = _t2i_case(tmp_path, "image", [5], image_bytes(120, 100, seed=7), max_image_pixels=32 * 24)
    _assert_skipped(report, "decompression_bomb", [5], path)
    assert _details(report, "decompression_bomb") == ["JPEG image of 120x100 = 12,000 pixels, above "
                                                      "--max-image-pixels 768"]


@pytest.mark.parametrize("captions", [None, "{not json", '["a list", "not an object"]', '{"0": 5}'])
def test_missing_or_unparsable_captions(tmp_path, captions):
    report, path = _t2i_case(tmp_path, "captions", [3], captions)
    _assert_skipped(report, "bad_captions", [3], path)


def test_unreadable_parquet_row_group(tmp_path):
    images, captions = _good_images(9), [json.dumps({"0": f"caption {i}"}) for i in range(9)]
    path = _t2i(tmp_path, images, captions, row_group_size=3)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    with open(path, "r+b") as stream:
        stream.seek(column.data_page_offset)
        stream.write(b"\xff" * 64)
    dataset, report = build("t2i", [path], tmp_path / "out")
    _assert_skipped(report, "unreadable_row_group", [3, 4, 5], path)
    assert [bytes(dataset[i].image(0).data) for i in range(len(dataset))] == images[:3] + images[6:]


def test_instruction_and_image_count_mismatch(tmp_path):
    images = [[image_bytes(16, 16, seed=10 * r + k) for k in range(3)] for r in range(4)]
    instructions = [[["a"], ["b"]], [["only one step"]], [["a"], []], [["a"], ["b"], ["c"]]]
    path = write_parquet(tmp_path / "edit.parquet", {"image_list": images, "instruction_list": instructions},
                         {"image_list": pa.list_(pa.binary()), "instruction_list": pa.list_(pa.list_(pa.string()))},
                         row_group_size=10)
    dataset, report = build("edit", [path], tmp_path / "out")
    _assert_skipped(report, "instruction_image_mismatch", [1, 2, 3], path)
    assert len(dataset) == 1 and dataset[0].origin[1] == 0


GOOD_TURNS = [{"from": "human", "value": "<image> What is it?"}, {"from": "gpt", "value": "A thing."}]


def _vlm_case(tmp_path, bad_rows, bad_line):
    (tmp_path / "img.png").write_bytes(image_bytes(20, 20, "RGB", "PNG"))
    lines = [{"image": "img.png", "conversations": GOOD_TURNS} for _ in range(5)]
    for row in bad_rows:
        lines[row] = bad_line
    path = write_jsonl(tmp_path / "sft.jsonl", lines)
    dataset, report = build("vlm", [path], tmp_path / "out", image_root=str(tmp_path))
    assert [dataset[i].origin[1] for i in range(len(dataset))] == [r for r in range(5) if r not in bad_rows]
    assert all(dataset[i].num_images == 1 for i in range(len(dataset)))
    return report, path


def test_invalid_json_line(tmp_path):
    report, path = _vlm_case(tmp_path, [0, 3], '{"image": "img.png", "conversations": [')
    _assert_skipped(report, "invalid_json", [0, 3], path, lines=[1, 4])


def test_missing_image_file(tmp_path):
    report, path = _vlm_case(tmp_path, [2], {"image": ["img.png", "gone.png"], "conversations": GOOD_TURNS})
    _assert_skipped(report, "missing_file", [2], path, lines=[3])


def test_missing_video_file(tmp_path):
    turns = [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "ok"}]
    report, path = _vlm_case(tmp_path, [4], {"video": "gone.mp4", "conversations": turns})
    _assert_skipped(report, "missing_file", [4], path, lines=[5])


def test_undecodable_video(tmp_path):
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    turns = [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "ok"}]
    report, path = _vlm_case(tmp_path, [1], {"video": "broken.mp4", "conversations": turns})
    _assert_skipped(report, "undecodable_video", [1], path, lines=[2])


@pytest.mark.parametrize("turns", [[{"from": "human", "value": "<image> only a question"}],
                                   [{"from": "human", "value": "<image> q"}, {"from": "gpt", "value": ""}]])
def test_conversation_without_a_loss_bearing_turn(tmp_path, turns):
    report, path = _vlm_case(tmp_path, [1], {"image": "img.png", "conversations": turns})
    _assert_skipped(report, "no_loss_turn", [1], path, lines=[2])


def test_empty_text(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "kept one"}, {"text": ""}, {"text": "kept two"}])
    dataset, report = build("text", [path], tmp_path / "out")
    _assert_skipped(report, "empty_text", [1], path, lines=[2])
    assert [dataset[i].text(0).tolist()[:-1] for i in range(2)] == [encode("kept one"), encode("kept two")]


def test_the_report_file_holds_counts_reasons_and_examples(tmp_path):
    report, _ = _t2i_case(tmp_path, "image", [1], b"junk")
    saved = json.loads((tmp_path / "out.report.json").read_text())
    assert saved["skips"] == report.data["skips"] and saved["rows"] == 6 and saved["samples"] == 5
    assert saved["reasons"]["undecodable_image"]


# --------------------------------------------------------------------------- the skip-rate threshold


def _cli_build(tmp_path, bad, *extra):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "" if i < bad else f"doc {i}"} for i in range(10)])
    from support.sources import tokenizer_dir

    return cli.main(["build", "--source", "text", "--input", path, "--tokenizer", tokenizer_dir(),
                     "--output", str(tmp_path / "out"), "--quiet", *extra])


def test_cli_exits_zero_when_the_skip_rate_is_within_the_limit(tmp_path, capsys):
    assert _cli_build(tmp_path, 1, "--max-skip-rate", "0.1") == 0
    assert "OK: skipped 10.00%" in capsys.readouterr().out


def test_cli_exits_one_when_the_skip_rate_exceeds_the_limit_and_says_why(tmp_path, capsys):
    assert _cli_build(tmp_path, 2, "--max-skip-rate", "0.1") == 1
    out = capsys.readouterr().out
    assert "20.00% of the rows were skipped, more than --max-skip-rate 10.00%" in out
    assert "skipped 2 × empty_text" in out


def test_cli_exits_one_when_nothing_was_built(tmp_path, capsys):
    assert _cli_build(tmp_path, 10, "--max-skip-rate", "1") == 1
    assert "nothing was built from 10 rows" in capsys.readouterr().out


def test_a_pixel_limit_above_pils_own_is_refused_up_front():
    from mmidx.sources import SourceOptions, pil_pixel_limit

    with pytest.raises(ValueError, match="PIL itself refuses larger images"):
        SourceOptions(max_image_pixels=pil_pixel_limit() + 1)


def test_a_text_longer_than_max_text_tokens_is_a_counted_skip(tmp_path):
    texts = ["short one", "a much longer text " * 20, "short two"]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": text} for text in texts])
    limit = len(encode(texts[0])) + 8
    assert len(encode(texts[1])) > limit
    dataset, report = build("text", [path], tmp_path / "out", max_text_tokens=limit)
    _assert_skipped(report, "text_too_long", [1], path, lines=[2])
    assert [dataset[i].text(0).tolist()[:-1] for i in range(2)] == [encode(texts[0]), encode(texts[2])]
    assert report.data["reasons"]["text_too_long"].startswith("a text of more tokens than --max-text-tokens")
    _, default = build("text", [path], tmp_path / "all")  # the default, 1M tokens, keeps every row
    assert default.data["samples"] == 3


def test_max_text_tokens_is_an_option_of_mmidx_build(tmp_path, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "one two three four five six"}, {"text": "x"}])
    assert cli.main(["build", "--source", "text", "--input", str(path), "--output", str(tmp_path / "out"),
                     "--tokenizer", tokenizer_dir(), "--max-text-tokens", "2", "--max-skip-rate", "1"]) == 0
    assert json.loads((tmp_path / "out.report.json").read_text())["skips"]["text_too_long"]["count"] == 1


@pytest.mark.parametrize("given", ["docs", "docs/", "docs/docs.jsonl"])
def test_skip_examples_name_a_relative_input_as_given(tmp_path, monkeypatch, given):
    (tmp_path / "docs").mkdir()
    write_jsonl(tmp_path / "docs" / "docs.jsonl", [{"text": "kept"}, {"text": ""}])
    monkeypatch.chdir(tmp_path)
    _, report = build("text", [given], tmp_path / "out")
    assert [example["file"] for example in report.data["skips"]["empty_text"]["examples"]] == ["docs/docs.jsonl"]
