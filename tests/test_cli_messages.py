"""What a newcomer meets first: usage errors in two lines, and bad input in one line naming the path and what to
do, in the words of the interface used (the command line's options, or mmidx.write's parameters)."""

import argparse
import json
import re

import pytest
from support.helpers import small_dataset
from support.sources import image_bytes, tokenizer_dir, write_jsonl, write_t2i_parquet

import mmidx
from mmidx.cli import build_parser, main
from mmidx.errors import command_line, option
from mmidx.ingest import BuildError
from mmidx.sources import SOURCE_NAMES, get_source
from mmidx.tokenizer import TokenizerError

COMMANDS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def run(argv, capsys):
    """(exit status, stderr lines) of one command, usage errors included."""
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit:
        code = exit.code
    return code, capsys.readouterr().err.strip().splitlines()


def build_argv(tmp_path, *extra, source="t2i", inputs=None, tokenizer=None):
    return ["build", "--source", source, "--input", *(inputs or [tmp_path / "in.parquet"]), "--output",
            tmp_path / "out", "--tokenizer", tokenizer or tokenizer_dir(), "--quiet", *extra]


@pytest.mark.parametrize("value", ["7", "-0.5", "1.01", "nan", "x"])
@pytest.mark.parametrize("command", ["build", "merge"])
def test_a_max_skip_rate_outside_0_to_1_is_one_usage_error(command, value, tmp_path, capsys):
    argv = (build_argv(tmp_path) if command == "build" else ["merge", tmp_path / "m", tmp_path / "a"])
    code, lines = run([*argv, f"--max-skip-rate={value}"], capsys)
    assert code == 2 and lines[-1] == (f"mmidx {command}: error: argument --max-skip-rate: {value!r} is not a "
                                       "fraction in [0, 1] (0.05: 5% of the rows)")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_usage_error_is_a_short_usage_and_one_line(command, capsys):
    code, lines = run([command, "--no-such-option"], capsys)  # argparse: mmidx's own usage, unless it misses more
    assert code == 2 and lines[0].startswith("usage: mmidx ") and "[options]" in lines[0]
    assert len(lines) == 2, lines
    assert re.match(rf"mmidx( {command})?: error: ", lines[-1])


def test_builds_usage_names_its_required_option_and_its_error_the_two_forms(tmp_path, capsys):
    code, lines = run(["build", "--tokenizer", "t", "--source", "t2i"], capsys)
    assert code == 2 and lines == ["usage: mmidx build --tokenizer TOKENIZER [options]",
                                   "mmidx build: error: give either --source, --input and --output, or --config, "
                                   "--dataset-info and --output-dir"]
    assert "--max-image-side" not in COMMANDS["build"].format_help()  # a hidden alias, in no usage or help


def test_the_max_image_side_alias_sets_max_image_size_and_its_errors_name_it(capsys):
    assert build_parser().parse_args(["build", "--tokenizer", "t", "--max-image-side", "512"]).max_image_size == 512
    assert run(["build", "--tokenizer", "t", "--max-image-size", "0"], capsys)[1][-1].startswith(
        "mmidx build: error: argument --max-image-size: '0'")
    assert run(["build", "--tokenizer", "t", "--max-image-side", "0"], capsys)[1][-1].startswith(
        "mmidx build: error: argument --max-image-side: '0'")


def test_mmidx_help_names_every_command_in_its_description():
    description = build_parser().description
    assert "..." not in description
    for name in COMMANDS:
        assert re.search(rf"\b{name}\b", description), name


def test_help_names_no_repository_path_and_builds_lists_every_sources_input_schema():
    for name, sub in COMMANDS.items():
        assert not re.search(r"docs/|\.md\b|guide/", sub.format_help()), name
    schemas = COMMANDS["build"].format_help().split("input schemas")[1]
    for name in SOURCE_NAMES:
        line = next(line for line in schemas.splitlines() if line.split()[:1] == [name])
        for extension in get_source(name).EXTENSIONS:  # the files the source really reads (.csv.gz: "also .gz")
            also_gz = extension.removesuffix(".gz") in line and "also .gz" in line
            assert extension in line or also_gz, (name, extension)
    assert "mmidx.write" in schemas


def test_sizes_are_written_one_way_in_every_help():
    build = " ".join(COMMANDS["build"].format_help().split())
    assert "(default: 256 MiB = 268,435,456 bytes)" in build  # --bytes-per-shard
    assert "(default: 2^27 = 134,217,728 pixels)" in build  # --max-image-pixels
    assert "(default: 32 MiB = 33,554,432 bytes)" in build  # --max-image-bytes
    for name, sub in COMMANDS.items():
        assert not re.search(r"default: \d{5,}", sub.format_help()), name  # no 268435456 beside 2^27


def test_mmidx_write_names_its_parameters_and_the_cli_its_options(tmp_path, capsys):
    def half_fail(i):
        if i % 2:
            raise ValueError("odd")
        return {"texts": ["a caption"], "images": [image_bytes(32, 32)],
                "views": [[mmidx.Element("text", 0), mmidx.Element("vae_image", 0, loss=True)]]}

    report = mmidx.write(half_fail, range(4), tmp_path / "out", tokenizer=tokenizer_dir(), progress=False)
    assert not report.ok and "more than max_skip_rate 1.00%" in report.message and "--" not in report.summary()
    with pytest.raises(BuildError, match=r"pass force=True to replace it") as error:
        mmidx.write(half_fail, range(6), tmp_path / "out", tokenizer=tokenizer_dir(), progress=False)
    assert "--" not in str(error.value)
    images = tmp_path / "photos"
    images.mkdir()
    (images / "a.jpg").write_bytes(image_bytes(32, 32))
    with pytest.raises(TokenizerError) as error:
        mmidx.write(half_fail, range(2), tmp_path / "other", tokenizer=images, progress=False)
    assert "--tokenizer" not in str(error.value) and "tokenizer is a folder written by save_pretrained" in str(
        error.value)
    assert (option("max_skip_rate"), option("force", True)) == ("max_skip_rate", "force=True")
    with command_line():
        assert (option("max_skip_rate"), option("force", True)) == ("--max-skip-rate", "--force")


def test_an_empty_or_truncated_parquet_names_the_file_and_what_to_do(tmp_path, capsys):
    empty = tmp_path / "in.parquet"
    empty.write_bytes(b"")
    for source in ("t2i", "edit", "hf"):
        code, lines = run(build_argv(tmp_path, source=source), capsys)
        assert code == 1 and lines == [f"mmidx build: {empty}: the file is empty (0 bytes), so it is not parquet: a "
                                       "copy or download that did not finish? Write it again, or leave it out of the "
                                       "inputs"], source
    write_t2i_parquet(tmp_path / "whole.parquet", [image_bytes(32, 32)], [{"0": "a cat"}], 1)
    empty.write_bytes((tmp_path / "whole.parquet").read_bytes()[:100])
    code, lines = run(build_argv(tmp_path), capsys)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"mmidx build: {empty}: not a readable parquet file")
    assert lines[0].endswith("write it again, or leave it out of the inputs")


def test_an_empty_jsonl_is_still_a_build_of_no_rows(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_bytes(b"")
    assert main([str(arg) for arg in build_argv(tmp_path, source="text", inputs=[tmp_path / "in.jsonl"])]) == 1
    assert "FAILED: the inputs hold no rows, so no dataset was written" in capsys.readouterr().out


@pytest.mark.parametrize("output", ["{tmp}", "{tmp}/pack", "{tmp}/pack."])
def test_show_refuses_an_output_that_is_no_picture_file_before_any_work(output, tmp_path, capsys):
    output = output.format(tmp=tmp_path)
    code, lines = run(["show", tmp_path / "no-such-dataset", "-o", output], capsys)  # refused before it is read
    assert code == 2 and lines[-1].startswith(f"mmidx show: error: -o {output}: ")
    assert lines[-1].endswith(f"{tmp_path}/pack0.png" if output == str(tmp_path) else f"{tmp_path}/pack.png")


def _data_yaml(tmp_path):
    path = tmp_path / "data.yaml"
    path.write_text(json.dumps({"groups": {"t2i": {"datasets": ["ds/t2i"]}, "vlm": {"datasets": ["ds/vlm"]}}}))
    return path


@pytest.mark.parametrize("argv", [["sample", "{yaml}", "0"], ["export", "{yaml}", "--to", "parquet", "{tmp}/out"],
                                  ["merge", "{tmp}/merged", "{yaml}"]])
def test_a_data_yaml_where_one_dataset_is_meant_lists_its_datasets(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _data_yaml(tmp_path)
    code, lines = run([arg.format(yaml="data.yaml", tmp=tmp_path) for arg in argv], capsys)
    assert code == 2 and lines[-1].endswith("data.yaml is a data YAML, not one dataset; give one of its datasets' "
                                            "prefixes: ds/t2i, ds/vlm")


def test_an_mmidx_data_yaml_given_as_a_bagel_config_says_what_to_pass(tmp_path, capsys):
    data = _data_yaml(tmp_path)
    info = tmp_path / "info.yaml"
    info.write_text("{}")
    code, lines = run(["build", "--config", data, "--dataset-info", info, "--output-dir", tmp_path / "o",
                       "--tokenizer", tokenizer_dir(), "--quiet"], capsys)
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"mmidx build: {data} looks like an mmidx data config")
    assert "t2i_pretrain:" in lines[0] and "mmidx-demo/bagel.yaml" in lines[0] and "unknown keys" not in lines[0]


def test_a_folder_without_tokenizer_files_names_the_files_looked_for(tmp_path, capsys):
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.jpg").write_bytes(image_bytes(32, 32))
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "hello"}])
    code, lines = run(build_argv(tmp_path, source="text", inputs=[path], tokenizer=str(photos)), capsys)
    assert code == 1 and lines == [f"mmidx build: {photos}: holds no tokenizer files (looked for tokenizer.json, "
                                   "tokenizer_config.json, vocab.json, merges.txt, vocab.txt, tokenizer.model, "
                                   "spiece.model, sentencepiece.bpe.model); --tokenizer is a folder written by "
                                   "save_pretrained, e.g. AutoTokenizer.from_pretrained(NAME).save_pretrained(FOLDER)"]


def test_a_folder_of_images_and_a_captions_file_points_to_mmidx_write(tmp_path, capsys):
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("a.jpg", "b.jpg"):
        (photos / name).write_bytes(image_bytes(32, 32))
    (photos / "captions.csv").write_text("file,caption\na.jpg,a cat\n")
    code, lines = run(build_argv(tmp_path, inputs=[f"{photos}/"]), capsys)
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"mmidx build: input directory '{photos}/' holds no .parquet files")
    assert "(it holds 2 .jpg, 1 .csv;" in lines[0] and "mmidx build --help" in lines[0]
    assert "built by mmidx.write from a Python function" in lines[0] and "Your own data" in lines[0]


def test_inspect_writes_every_statistic_as_the_counts_beside_it():
    from mmidx.cli.inspect import _describe

    stats = {"count": 5, "min": 12, "mean": 1_234_567.891, "p50": 2_000_000.0, "p99": 2_023_090.5, "max": 3_000_001}
    assert _describe(stats) == "min 12  mean 1,234,567.89  p50 2,000,000  p99 2,023,090.5  max 3,000,001"


def test_merge_counts_datasets_in_the_right_number(tmp_path, capsys):
    small_dataset(tmp_path / "a")
    small_dataset(tmp_path / "b", seed=1)
    assert main(["merge", str(tmp_path / "one"), str(tmp_path / "a")]) == 0
    one = capsys.readouterr().out
    assert "OK: merged 1 dataset\n" in one and "from 1 dataset in" in one and "unit" not in one
    assert main(["merge", str(tmp_path / "two"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    two = capsys.readouterr().out
    assert "OK: merged 2 datasets\n" in two and "from 2 datasets in" in two


def test_shows_table_keeps_every_column_inside_the_picture_and_loses_no_split():
    from types import SimpleNamespace

    from mmidx.toolkit.show import _font, sample_table, split_runs

    assert split_runs(["full"] * 11 + ["causal", "causal", "noise"], [731] * 11 + [13, 87, 1026]) == [
        "full:731 x11", "causal:13", "causal:87", "noise:1026"]
    modes, lengths = ["full"] * 3 + ["causal"] * 30, [1371, 731, 731, *range(10, 40)]
    long = {"dataset_name": "a_very_long_group_name_of_unified_edit", "dataset": "/data/a_dataset_with_a_long_name",
            "sample": 123456, "view": 3}
    batch = SimpleNamespace(attn_modes=[modes, ["noise"]], split_lens=[lengths, [1026]], sample_lens=[9000, 1026],
                            batch_data_indexes=[long, {"dataset_name": "t2i", "dataset": "/data/t2i", "sample": 0,
                                                       "view": 0}])
    font, width = _font(12), 600
    lines = sample_table(batch, font, width)
    for line in lines:
        for x, text in line:
            assert x >= 6 and x + font.getlength(text) <= width - 6, text  # nothing runs off the right edge
    splits_x = lines[1][-1][0]
    shown = " ".join(text for line in lines[1:] for x, text in line if x == splits_x).split()
    assert shown[:3] == ["full:1371", "full:731", "x2"] and "causal:39" in shown and "noise:1026" in shown
    assert len(lines) > 3  # the first sample's splits wrapped onto lines of their own
