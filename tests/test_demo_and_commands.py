"""The README's main command (mmidx demo) and the index/show commands work end to end."""

import argparse
import json

import pytest
from support.sources import build, write_jsonl

from mmidx.cli import build_parser, main
from mmidx.cli.common import dataset_prefix
from mmidx.toolkit.demo import STEPS, format_summary


def test_demo_builds_indexes_and_packs_every_group(demo):
    assert all(report.ok for report in demo["reports"]) and demo["problems"] == []
    assert {r.data["source"] for r in demo["reports"]} == {"t2i", "edit", "vlm"}
    stats = demo["index"].stats
    assert demo["packs"] == stats["num_packs"] >= 2
    assert demo["tokens"] > 0 and stats["excluded"] == 0
    assert len(demo["dense_masks"]) >= 1 and demo["block_mask"].shape[-1] == demo["config"].packing.max_num_tokens


def test_demo_summary_names_each_stage(demo):
    text = format_summary(demo)
    for word in ("generate", "build", "index", "batches", "masks", "verify", "all datasets OK", "tokens/s"):
        assert word in text


def test_index_command_prints_and_caches_statistics(demo, tmp_path, capsys):
    data_yaml = f"{demo['workdir']}/datasets/data.yaml"
    assert main(["index", data_yaml, "--cache-dir", str(tmp_path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_packs"] == demo["index"].stats["num_packs"]
    assert len(list(tmp_path.iterdir())) == 1


def test_show_refuses_a_pack_that_does_not_exist(demo, capsys):
    assert main(["show", f"{demo['workdir']}/datasets/data.yaml", "--pack", "100000"]) == 1
    assert "out of range" in capsys.readouterr().err


def test_demo_tells_each_step_as_it_starts(demo):
    lines = [line for line, _ in demo["steps"]]
    assert len(lines) == len(STEPS) and lines[0] == "[1/7] generating a BAGEL-format corpus..."
    built = [exists for _, exists in demo["steps"]]
    assert built == [False, False] + [True] * (len(STEPS) - 2)  # told before the build, not after it all


def test_index_says_whether_it_built_or_reused_the_cache(demo, tmp_path, capsys):
    data_yaml = f"{demo['workdir']}/datasets/data.yaml"
    for word in ("built", "reused"):
        assert main(["index", data_yaml, "--cache-dir", str(tmp_path)]) == 0
        assert capsys.readouterr().out.splitlines()[0].endswith(f"({word})")
    assert main(["index", data_yaml]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "pack index (not cached)"


@pytest.fixture(scope="module")
def text_prefix(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    lines = [{"text": " ".join(["a red cat on the mat"] * (1 + row % 5))} for row in range(20)]
    return build("text", [write_jsonl(folder / "docs.jsonl", lines)], folder / "text")[0].prefix


def test_gpt_index_says_why_it_holds_more_samples_than_asked_for(text_prefix, capsys):
    assert main(["index", "--gpt", text_prefix, "--seq-length", "8"]) == 0
    one_epoch = int(capsys.readouterr().out.split(": ")[1].split(" GPT")[0].replace(",", ""))
    assert main(["index", "--gpt", text_prefix, "--seq-length", "8", "--num-samples", str(one_epoch - 3)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{text_prefix}: {one_epoch:,} GPT samples of 8 tokens (not cached); "
                           f"{one_epoch - 3:,} asked for: as Megatron's GPTDataset, the index covers whole epochs")
    assert "(1 here)" in line
    assert main(["index", "--gpt", text_prefix, "--seq-length", "8", "--num-samples", str(one_epoch)]) == 0
    assert "asked for" not in capsys.readouterr().out


def test_gpt_index_says_where_it_is_cached_and_refuses_multimodal_datasets(demo, text_prefix, tmp_path, capsys):
    assert main(["index", "--gpt", text_prefix, "--seq-length", "8"]) == 0
    assert capsys.readouterr().out.strip().endswith("GPT samples of 8 tokens (not cached)")
    assert main(["index", "--gpt", text_prefix, "--seq-length", "8", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"(cached in {tmp_path})")
    multimodal = demo["reports"][0].data["output"]
    assert main(["index", "--gpt", multimodal, "--seq-length", "8"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"mmidx index: {multimodal}: a multimodal dataset; index --gpt builds GPT samples of text datasets only "
        "(use mmidx index without --gpt for the pack index)")


def test_inspect_and_verify_cover_every_dataset_of_a_data_yaml(demo, capsys):
    data_yaml = f"{demo['workdir']}/datasets/data.yaml"
    prefixes = [r.data["output"] for r in demo["reports"]]
    assert main(["verify", data_yaml]) == 0
    assert [line.split(": OK")[0] for line in capsys.readouterr().out.splitlines()] == prefixes
    assert main(["inspect", "--json", data_yaml]) == 0
    assert [info["prefix"] for info in json.loads(capsys.readouterr().out)] == prefixes
    assert main(["inspect", data_yaml]) == 0
    assert capsys.readouterr().out.count("mmidx dataset ") == len(prefixes)


def test_a_prefix_may_name_one_of_its_files(demo, tmp_path, capsys):
    prefix = demo["reports"][0].data["output"]
    assert main(["inspect", "--json", prefix]) == 0
    expected = json.loads(capsys.readouterr().out)
    for suffix in (".idx", ".bin", ".meta.json", ".images", ".plan"):
        assert main(["inspect", "--json", prefix + suffix]) == 0
        assert json.loads(capsys.readouterr().out) == expected
    assert dataset_prefix(prefix + ".idx") == prefix
    (tmp_path / "x.bin.idx").write_bytes(b"")  # a prefix that itself ends in .bin keeps it
    assert dataset_prefix(str(tmp_path / "x.bin")) == str(tmp_path / "x.bin")
    assert dataset_prefix("out/new.idx") == "out/new"
    merge = build_parser().parse_args(["merge", "a.bin", "out/m.shards", "--output", "out/m.idx"])
    assert (merge.output, merge.input) == ("out/m", ["a", "out/m.shards"])
    build_args = build_parser().parse_args(["build", "--output", "out/b.meta.json", "--tokenizer", "t"])
    assert build_args.output == "out/b"


def test_help_shows_defaults_and_exit_statuses_without_markup():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for help_text in [parser.format_help(), *(sub.format_help() for sub in commands.values())]:
        assert "``" not in help_text and "exit status: 0 success; 1 failure" in help_text
        assert "(default: None)" not in help_text and "(default: False)" not in help_text
    assert "(default: 20)" in commands["bench"].format_help()
    assert "(default: 1024)" in commands["show"].format_help()
    build_help = " ".join(commands["build"].format_help().split())
    assert "(default: 4)" in build_help and "(default: 0.01; --source urls: 1.0)" in build_help
    assert "not one epoch of each dataset" in " ".join(commands["index"].format_help().split())
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
