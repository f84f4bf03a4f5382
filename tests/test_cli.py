"""`mmidx inspect` and `mmidx verify` on sound and broken datasets."""

import json

from support.helpers import small_dataset

from mmidx.cli import main


def test_inspect_prints_counts_and_json(tmp_path, capsys):
    small_dataset(tmp_path / "ds", count=3)
    assert main(["inspect", str(tmp_path / "ds")]) == 0
    text = capsys.readouterr().out
    assert "samples 3" in text and "vae_image 12" in text and "PNG 3" in text
    assert main(["inspect", str(tmp_path / "ds"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["samples"] == 3 and info["views"] == 6 and info["images"]["count"] == 3
    assert info["element_kinds"]["vae_image"] == {"count": 12, "loss": 6, "enable_cfg": 6}
    assert info["format_version"] == 1


def test_verify_exits_1_naming_the_broken_file(tmp_path, capsys):
    small_dataset(tmp_path / "ds")
    assert main(["verify", str(tmp_path / "ds")]) == 0
    data = bytearray((tmp_path / "ds.images").read_bytes())
    data[0] ^= 1
    (tmp_path / "ds.images").write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "ds")]) == 1
    assert "ds.images: xxh3_128 checksum differs" in capsys.readouterr().err


def test_open_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert "no dataset here" in capsys.readouterr().err
