"""The README's main command (mmidx demo) and the index/show commands work end to end."""

import json

from mmidx.cli import main
from mmidx.demo import format_summary


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


def test_gpt_index_command_needs_a_sequence_length(demo, capsys):
    assert main(["index", "--gpt", demo["reports"][0].data["output"]]) == 2
