"""A build split over nodes (``--num-nodes``) and joined by ``mmidx merge`` equals one build, byte for byte."""

import json
import os
import random
import subprocess
import sys

import pytest
from support.build_cases import build_command, same_dataset_files

from mmidx import cli
from mmidx.ingest import report_path
from mmidx.read.dataset import MMIDXDataset


def _counts(report):
    keep = ("rows", "samples", "skipped", "warned", "views", "images", "tokens", "skips", "warnings", "units", "ok")
    return {key: report[key] for key in keep}


@pytest.mark.parametrize("source", ["t2i", "edit", "vlm", "text"])
def test_a_three_way_split_merged_in_any_order_is_byte_identical_to_one_build(source, tmp_path, capsys):
    assert cli.main(build_command(source, tmp_path / "one" / "out")) == 0
    for rank in range(3):  # each node writes its own shard folder, as on machines without a shared disk
        assert cli.main(build_command(source, tmp_path / f"node{rank}" / "out", "--num-nodes", "3",
                                      "--node-rank", str(rank))) == 0
        assert not (tmp_path / f"node{rank}" / "out.idx").exists()  # a node stops before merging
    # each node's shard folder, or the prefix the node built to (as the user typed it for --output)
    folders = [str(tmp_path / f"node{rank}" / ("out.shards" if rank % 2 else "out")) for rank in range(3)]
    random.Random(source).shuffle(folders)
    assert cli.main(["merge", *folders, "--output", str(tmp_path / "split" / "out")]) == 0
    assert same_dataset_files(tmp_path / "one" / "out", tmp_path / "split" / "out")
    one = json.loads(report_path(tmp_path / "one" / "out").read_text())
    split = json.loads(report_path(tmp_path / "split" / "out").read_text())
    assert one["units"] >= 3 and _counts(one) == _counts(split)


def test_merge_refuses_missing_units_and_shards_of_another_build(tmp_path, capsys):
    for rank in range(2):
        assert cli.main(build_command("text", tmp_path / f"node{rank}" / "out", "--num-nodes", "3",
                                      "--node-rank", str(rank))) == 0
    capsys.readouterr()
    shards = [str(tmp_path / f"node{rank}" / "out.shards") for rank in range(2)]
    assert cli.main(["merge", *shards, "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "have no finished shard" in err and len(err.strip().splitlines()) == 1
    assert cli.main(build_command("text", tmp_path / "other" / "out", "--num-nodes", "3", "--node-rank", "2",
                                  "--seed", "7")) == 0
    capsys.readouterr()
    assert cli.main(["merge", *shards, str(tmp_path / "other" / "out.shards"), "--output", str(tmp_path / "out")]) == 1
    assert "belong to different builds" in capsys.readouterr().err
    assert cli.main(build_command("t2i", tmp_path / "t2i" / "out", "--num-nodes", "3", "--node-rank", "0")) == 0
    capsys.readouterr()
    assert cli.main(["merge", shards[0], str(tmp_path / "t2i" / "out.shards"), "--output", str(tmp_path / "out")]) == 1
    assert "different kind of source ('t2i' vs 'text')" in capsys.readouterr().err
    assert not (tmp_path / "out.idx").exists()


def test_merge_of_whole_datasets_concatenates_them_and_refuses_mixed_kinds(tmp_path, capsys):
    for source in ("t2i", "edit", "text"):
        assert cli.main(build_command(source, tmp_path / source)) == 0
    assert cli.main(["merge", str(tmp_path / "t2i"), str(tmp_path / "edit"), "-o", str(tmp_path / "both")]) == 0
    t2i, edit, both = (MMIDXDataset(tmp_path / name) for name in ("t2i", "edit", "both"))
    assert len(both) == len(t2i) + len(edit)
    assert bytes(both[len(t2i)].image(0).data) == bytes(edit[0].image(0).data)
    assert both.metadata["merged_from"] == [str(tmp_path / "t2i"), str(tmp_path / "edit")]
    capsys.readouterr()
    assert cli.main(["merge", str(tmp_path / "t2i"), str(tmp_path / "text"), "-o", str(tmp_path / "mixed")]) == 1
    assert "their kinds differ (text vs multimodal)" in capsys.readouterr().err
    assert not (tmp_path / "mixed.idx").exists()


def test_the_library_never_imports_the_command_line_and_ray_only_when_asked_for():
    code = ("import sys, mmidx.ingest, mmidx.toolkit.demo; "
            "assert 'mmidx.cli' not in sys.modules and 'ray' not in sys.modules, sorted(sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
