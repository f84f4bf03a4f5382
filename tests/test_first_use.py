"""A new user's first dataset (issue 34): defaults that agree, schemas checked up front, one-line errors."""

import json
import re

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
