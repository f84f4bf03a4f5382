"""A new user's first dataset (issue 34): defaults that agree, schemas checked up front, one-line errors."""

import json
import os
import re
from pathlib import Path

import pytest
from support.sources import image_bytes, tokenizer_dir, write_t2i_parquet

from mmidx.cli import main


@pytest.fixture(scope="module")
def large_t2i(tmp_path_factory):
    """A t2i dataset of 1,024-px images built as the README says, nothing else configured."""
    root = tmp_path_factory.mktemp("first")
    (root / "data").mkdir()
    images = [image_bytes(1024, 768 if i % 2 else 1024, seed=i) for i in range(4)]
    write_t2i_parquet(root / "data" / "part0.parquet", images, [{"a": f"picture {i}"} for i in range(4)], 2)
    prefix = str(root / "ds" / "t2i")
    assert main(["build", "--source", "t2i", "--input", str(root / "data"), "--tokenizer", tokenizer_dir(),
                 "--output", prefix, "--quiet"]) == 0
    return root, prefix


def test_a_t2i_dataset_of_1024_px_images_indexes_shows_and_benches_from_a_bare_prefix(large_t2i, capsys):
    root, prefix = large_t2i
    assert main(["index", prefix, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["samples"] == 4 and stats["num_packs"] >= 1
    assert main(["show", prefix, "--pack", "0", "-o", str(root / "pack.png")]) == 0
    assert (root / "pack.png").stat().st_size > 0
    capsys.readouterr()
    assert main(["bench", prefix, "--packs", "2", "--workers", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["packs"] == 1


def _subparsers():
    import argparse

    from mmidx.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, action


def test_commands_are_listed_in_pipeline_order_build_first(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = re.findall(r"^    (\w+) ", capsys.readouterr().out, re.M)
    assert listed[:4] == ["build", "merge", "inspect", "verify"]
    assert listed.index("index") < listed.index("show") < listed.index("bench") and listed[-1] == "demo"


def test_help_writes_every_default_one_way_and_names_datasets_one_way():
    _, commands = _subparsers()
    for name, sub in commands.choices.items():
        for action in sub._actions:
            text = action.help or ""
            # argparse's "(default: …)", never "default 16", "; default", "(default 0.01"
            for match in re.finditer(r"default", text):
                assert text[max(0, match.start() - 1):match.end() + 2] == "(default: ", (name, text)
            if not action.option_strings and action.dest in ("config", "paths", "path", "prefix"):
                assert action.metavar in ("PREFIX", "PREFIX_OR_DATA_YAML"), (name, action.dest, action.metavar)


@pytest.mark.parametrize("command", ["build", "index", "bench", "precache", "export", None])
def test_help_wraps_at_the_terminal_width(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main([command, "--help"] if command else ["--help"])
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)


def test_build_help_groups_its_options_by_source(capsys):
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    out = capsys.readouterr().out
    headings = [line for line in out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    for words in ("what to build", "how it runs", "images and video", "JSONL", "Hugging Face", "URL tables"):
        assert any(words in heading for heading in headings), (words, headings)
    _, commands = _subparsers()
    options = commands.choices["build"]._option_string_actions
    assert {action for action in options.values() if "--help" not in action.option_strings} <= {
        action for group in commands.choices["build"]._action_groups[2:] for action in group._group_actions}


DOCS = Path(__file__).resolve().parent.parent / "docs" / "reference"


def _accepted_keys() -> set[str]:
    """Every key DataConfig.from_dict accepts, as the page writes it."""
    from dataclasses import fields

    from mmidx.config import GROUP_KEYS, IGNORED_GROUP_KEYS, TOP_KEYS, DataConfig
    from mmidx.images.transform import ImageTransform

    keys = set(TOP_KEYS) | {f"groups.NAME.{key}" for key in (*GROUP_KEYS, *IGNORED_GROUP_KEYS)}
    keys |= {f"groups.NAME.image_transform_args.{f.name}" for f in fields(ImageTransform)}
    for section in ("packing", "dropout", "geometry"):
        cls = next(f for f in fields(DataConfig) if f.name == section).default_factory
        keys |= {f"{section}.{f.name}" for f in fields(cls)}
    return keys


def test_the_data_config_page_lists_every_key_the_config_accepts():
    page = (DOCS / "data-config.md").read_text()
    assert set(re.findall(r"^\| `([\w.]+)` \|", page, re.M)) == _accepted_keys()


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("groups: {g: {datasets: [x]}}\ngeometri: {}", "unknown key geometri; the known ones are groups,"),
    ("groups: {g: {datasets: [x]}}\ngeometry: {max_latent: 64}", "geometry: unknown key max_latent;"),
    ("groups: {g: {datasets: [x]}}\npacking: {max_num_tokens: big}",
     "packing.max_num_tokens must be an integer, got a string ('big')"),
    ("groups: {g: {datasets: [x]}}\ngeometry: {max_latent_size: -64}",
     "geometry.max_latent_size must be a positive integer, got -64"),
    ("groups: {g: {datasets: [x]}}\ngeometry: [64]", "geometry must be a mapping of vit_patch_size"),
    ("groups: {g: {datasets: [x], weight: heavy}}", "groups.g.weight must be a number, got a string ('heavy')"),
    ("groups: {g: {datasets: x}}", "groups.g.datasets must be a list"),
    ("groups: {g: {datasets: [x], is_mandatory: 1}}", "groups.g.is_mandatory must be true or false"),
    ("groups: {g: {datasets: [x], image_transform_args: {max_image_size: 1024.5, min_image_size: 512, "
     "image_stride: 16}}}", "groups.g.image_transform_args.max_image_size must be an integer"),
    ("groups: {g: {datasets: [x]}}\ndropout: {text: yes}", "dropout.text must be a number, got a boolean"),
    ("groups: {g: {datasets: [x]}}\nseed: 1.5", "seed must be an integer"),
    ("packing: {}", "the data config needs groups"),
])
def test_a_bad_data_yaml_is_one_line_naming_the_file_and_the_key(yaml_text, message, tmp_path, capsys):
    path = tmp_path / "data.yaml"
    path.write_text(yaml_text)
    assert main(["index", str(path)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mmidx index: {path}: "), lines
    assert message in lines[0], lines[0]


def _build(tmp_path, source, inputs, capsys):
    code = main(["build", "--source", source, "--input", *map(str, inputs), "--tokenizer", tokenizer_dir(),
                 "--output", str(tmp_path / "out" / "ds"), "--quiet"])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(("source", "given", "said"), [
    ("vlm", "parquet", "this is parquet: did you mean --source t2i/edit/hf/urls? (--source vlm reads JSON lines"),
    ("text", "parquet", "this is parquet: did you mean --source t2i/edit/hf/urls?"),
    ("t2i", "jsonl", "this is JSON lines: did you mean --source vlm/chat/text/video_gen/prompts/urls?"),
    ("text", "tar", "this is a tar archive: did you mean --source wds?"),
    ("chat", "png", "this is binary data"),
    ("t2i", "csv", "this is text: did you mean --source prompts/urls? (--source t2i reads parquet)"),
])
def test_a_file_the_source_cannot_read_names_the_sources_that_can(source, given, said, tmp_path, capsys):
    import tarfile

    path = tmp_path / f"input.{given}"
    if given == "parquet":
        write_t2i_parquet(path, [image_bytes(32, 32)], [{"0": "a cat"}], 1)
    elif given == "jsonl":
        path.write_text('{"text": "hello"}\n')
    elif given == "csv":
        path.write_text("url,caption\nhttps://example.com/cat.jpg,a cat\n")
    elif given == "tar":
        with tarfile.open(path, "w") as tar:
            tar.add(__file__, arcname="x.txt")
    else:
        path.write_bytes(image_bytes(32, 32, fmt="PNG"))
    code, lines = _build(tmp_path, source, [path], capsys)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"mmidx build: {path}: "), lines
    assert said in lines[0], lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.bin"))


def test_t2i_captions_as_plain_strings_are_one_line_before_the_build(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"image": [image_bytes(32, 32)] * 3, "captions": ["a cat", "a dog", "a cow"]}), path)
    code, lines = _build(tmp_path, "t2i", [path], capsys)
    assert code == 1 and len(lines) == 1, lines
    assert "captions are not BAGEL's JSON objects of strings" in lines[0] and "'a cat'" in lines[0]
    assert "--source hf --caption-column captions" in lines[0]
    assert not (tmp_path / "out" / "ds.shards").exists()  # refused before any unit was built


def test_hf_parses_bagel_json_caption_cells_instead_of_tokenizing_the_json(tmp_path, capsys):
    from support.sources import encode, texts_of

    from mmidx.read.dataset import MMIDXDataset

    captions = [{"0": "a red cat", "1": "a cat"}, {"caption": "a dog"}]
    path = write_t2i_parquet(tmp_path / "t2i.parquet", [image_bytes(64, 64, seed=i) for i in range(2)], captions, 2)
    code, lines = _build(tmp_path, "hf", [path], capsys)
    assert code == 0, lines
    dataset = MMIDXDataset(tmp_path / "out" / "ds")
    for index, caption in enumerate(captions):
        assert sorted(texts_of(dataset[index])) == sorted(encode(text) for text in caption.values())


def test_export_writes_t2i_captions_back_with_their_keys_and_repeats(tmp_path, capsys):
    import pyarrow.parquet as pq

    captions = [{"short": "a cat", "long": "a red cat on a mat", "alt": "a cat"}, {"0": "a dog", "1": "a pup"},
                {"caption": "a cow"}]
    source = tmp_path / "in"
    source.mkdir()
    write_t2i_parquet(source / "t2i.parquet", [image_bytes(64, 64, seed=i) for i in range(3)], captions, 3)
    code, lines = _build(tmp_path, "t2i", [source], capsys)
    assert code == 0, lines
    assert main(["export", str(tmp_path / "out" / "ds"), "--to", "parquet", str(tmp_path / "back")]) == 0
    written = pq.read_table(tmp_path / "back" / "t2i.parquet").column("captions").to_pylist()
    assert [list(json.loads(cell).items()) for cell in written] == [list(c.items()) for c in captions]  # in order


@pytest.mark.parametrize("name", ["Qwen2-7B/", "{tmp}/no/such/tokenizer", "./tok"])
def test_a_missing_tokenizer_folder_says_where_it_looked(name, tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "hello"}\n')
    name = name.format(tmp=tmp_path)
    assert main(["build", "--source", "text", "--input", str(path), "--tokenizer", name,
                 "--output", str(tmp_path / "ds"), "--quiet"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"mmidx build: {name}: no folder or file {os.path.abspath(name)}; --tokenizer is a "
                           "folder written by save_pretrained, a tokenizer.json file, or a Hugging Face org/name id")


def test_sample_output_of_a_corrupt_image_writes_nothing_and_hints_at_verify(tmp_path, capsys):
    from mmidx.read.dataset import MMIDXDataset

    source = tmp_path / "in"
    source.mkdir()
    write_t2i_parquet(source / "t2i.parquet", [image_bytes(64, 64, fmt="PNG", seed=i) for i in range(2)],
                      [{"0": "a"}, {"0": "b"}], 2)
    assert _build(tmp_path, "t2i", [source], capsys)[0] == 0
    prefix = str(tmp_path / "out" / "ds")
    stored = bytes(MMIDXDataset(prefix)[1].images[0].data)
    images = Path(prefix + ".images")
    blob = bytearray(images.read_bytes())
    start = blob.find(stored)
    blob[start:start + 64] = bytes(64)  # the PNG signature and header gone: no longer an image
    images.write_bytes(bytes(blob))
    assert main(["sample", prefix, "1", "-o", str(tmp_path / "images")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mmidx sample: {prefix}: image 0 of sample 1 does not decode")
    assert f"run mmidx verify --decode {prefix}" in lines[0]
    assert not (tmp_path / "images").exists()
    assert main(["sample", prefix, "0", "-o", str(tmp_path / "images")]) == 0  # a sound one is written
    assert len(list((tmp_path / "images").iterdir())) == 1


@pytest.mark.parametrize("text_dropout", [0.0, 1.0])
def test_show_says_why_its_tokens_differ_from_the_index(text_dropout, large_t2i, tmp_path, capsys):
    _, prefix = large_t2i
    data = tmp_path / "data.yaml"
    data.write_text(f"groups: {{g: {{datasets: [{prefix}], image_transform_args: {{image_stride: 16, "
                    f"max_image_size: 512, min_image_size: 256}}}}}}\ndropout: {{text: {text_dropout}}}\n")
    assert main(["index", str(data), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_packs"] == 1  # the one pack holds every token the index counted
    assert main(["show", str(data), "-o", str(tmp_path / "pack.png")]) == 0
    line = capsys.readouterr().out.strip()
    shown = int(re.search(r"pack 0, ([\d,]+) tokens", line).group(1).replace(",", ""))
    if text_dropout == 0.0:
        assert shown == stats["tokens"] and "dropout" not in line, line
    else:  # every caption dropped: the index's count, and why it differs
        assert shown < stats["tokens"], line
        assert f"({stats['tokens']:,} as indexed: CFG dropout dropped {stats['tokens'] - shown:,} tokens" in line


def test_index_output_counts_in_the_right_number_and_a_pack_index_repr_is_short(large_t2i, capsys):
    from mmidx.config import config_for
    from mmidx.index.pack_index import build_pack_index

    _, prefix = large_t2i
    assert main(["index", prefix]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\b1 packs\b|\b0 pack\b", out) is None, out
    assert re.search(r"max deferral \d+ packs?\b", out), out
    index = build_pack_index(config_for([prefix]))
    text = repr(index)
    assert text == f"PackIndex({len(index):,} pack{'s' if len(index) != 1 else ''}, 4 items, groups 0:t2i, in memory)"
    assert "memmap" not in text and "array" not in text


def test_an_interrupted_build_says_a_rerun_resumes(monkeypatch, capsys):
    from mmidx.cli import build as build_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_cli, "cmd_build", interrupted)
    assert main(["build", "--source", "text", "--input", "x.jsonl", "--tokenizer", "t", "--output", "o"]) == 130
    assert capsys.readouterr().err.strip() == ("mmidx build: interrupted; rerun the same command to resume: the "
                                               "work units that finished are reused")


def test_the_sources_page_has_a_section_for_every_source_and_its_t2i_example_builds(tmp_path, capsys, monkeypatch):
    from mmidx.sources import SOURCE_NAMES

    page = (DOCS / "sources.md").read_text()
    assert re.findall(r"^## `(\w+)`$", page, re.M) == list(SOURCE_NAMES)
    example = re.search(r"## `t2i`.*?```python\n(.*?)```", page, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "sources.md", "exec"), {})
    code, lines = _build(tmp_path, "t2i", [tmp_path / "t2i.parquet"], capsys)
    assert code == 0, lines


def test_every_command_that_lays_out_packs_takes_the_geometry_options(large_t2i, tmp_path):
    from mmidx.cli import build_parser
    from mmidx.toolkit.view.catalog import Catalog

    geometry = ["--max-latent-size", "64", "--max-num-patch-per-side", "80", "--interpolate-pos"]
    for command in ("index", "show", "bench", "view"):
        args = build_parser().parse_args([command, "x.yaml", *geometry])
        assert (args.max_latent_size, args.max_num_patch_per_side, args.interpolate_pos) == (64, 80, True)
    _, prefix = large_t2i
    data = tmp_path / "data.yaml"
    data.write_text(f"groups: {{g: {{datasets: [{prefix}], image_transform_args: {{image_stride: 16, "
                    f"max_image_size: 1024, min_image_size: 512}}}}}}\ngeometry: {{vit_patch_size: 14}}\n")
    config = Catalog([str(data)], geometry={"max_latent_size": 64}).config
    assert (config.geometry.max_latent_size, config.geometry.vit_patch_size) == (64, 14)
