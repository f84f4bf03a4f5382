"""Nothing is lost: no command replaces another dataset at its output unless asked (``--force``), none leaves a
report describing other data, and an output prefix that names a folder (``out/``) is refused."""

import json
import shutil

import pytest
from support.build_cases import build_command
from support.helpers import small_dataset
from support.sources import tokenizer_dir

import mmidx
from mmidx import Element, cli
from mmidx import format as fmt
from mmidx.format import PrefixError
from mmidx.ingest import merge_into, report_path
from mmidx.ingest.merge import merge_datasets
from mmidx.ingest.plan import BuildError
from mmidx.ingest.writer import DatasetBuilder
from mmidx.read.dataset import MMIDXDataset


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two finished builds with their reports: ds/t2i (t2i) and ds/mine (edit), as in the issue."""
    folder = tmp_path_factory.mktemp("built")
    for source, name in (("t2i", "t2i"), ("edit", "mine")):
        assert cli.main(build_command(source, folder / name)) == 0
    return folder


def _copy(built, tmp_path, *names):
    folder = tmp_path / "ds"
    folder.mkdir()
    for name in names:
        for path in built.glob(f"{name}.*"):
            shutil.copy2(path, folder / path.name)
    return folder


def _files(prefix):
    """Every file of the dataset at ``prefix`` and beside it (its report), by name."""
    return {path.name: path.read_bytes() for path in prefix.parent.glob(prefix.name + ".*")}


def _sample(number):
    return {"texts": [f"text {number}"], "images": [], "views": [Element("text", 0, loss=True)]}


@pytest.mark.parametrize("argv", [["merge", "{ds}/t2i", "{ds}/mine"],  # "join these two", in the old form
                                  ["merge", "{ds}/mine", "--output", "{ds}/t2i"]])
def test_merge_refuses_to_replace_another_dataset_and_leaves_it_and_its_report_as_they_were(built, tmp_path, capsys,
                                                                                           argv):
    ds = _copy(built, tmp_path, "t2i", "mine")
    before = _files(ds / "t2i")
    assert len(before) == 6  # idx, bin, images, plan, meta.json and report.json
    assert cli.main([part.format(ds=ds) for part in argv]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"mmidx merge: {ds / 't2i'} holds a dataset built from other inputs or options (see "
                     f"{ds / 't2i'}.report.json); pass --force to replace it, or choose another output")
    assert _files(ds / "t2i") == before


def test_merge_with_force_replaces_it_and_the_report_then_describes_the_new_data(built, tmp_path):
    ds = _copy(built, tmp_path, "t2i", "mine")
    assert cli.main(["merge", str(ds / "mine"), "--output", str(ds / "t2i"), "--force"]) == 0
    merged, mine = MMIDXDataset(ds / "t2i"), MMIDXDataset(ds / "mine")
    assert len(merged) == len(mine) and bytes(merged[0].image(0).data) == bytes(mine[0].image(0).data)
    report = json.loads(report_path(ds / "t2i").read_text())
    assert report["meta_sha256"] == merged.metadata["meta_sha256"] and report["merged_from"] == [str(ds / "mine")]
    assert report["samples"] == len(mine)


def test_a_rerun_of_the_same_merge_reuses_its_result_but_a_changed_input_makes_it_another(built, tmp_path, capsys):
    ds = _copy(built, tmp_path, "t2i", "mine")
    argv = ["merge", str(ds / "t2i"), str(ds / "mine"), "-o", str(ds / "both")]
    assert cli.main(argv) == 0
    written = fmt.file_path(ds / "both", "idx").stat().st_mtime_ns
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert "OK: already merged: merged 2 datasets" in capsys.readouterr().out
    assert fmt.file_path(ds / "both", "idx").stat().st_mtime_ns == written  # nothing written again
    for path in built.glob("t2i.*"):  # ds/mine is now another dataset: the merge's result is not this merge's
        shutil.copy2(path, ds / path.name.replace("t2i", "mine"))
    assert cli.main(argv) == 1
    assert "holds a dataset built from other inputs or options" in capsys.readouterr().err


def test_the_old_form_with_the_output_first_still_merges_with_one_deprecation_line(built, tmp_path, capsys):
    ds = _copy(built, tmp_path, "t2i", "mine")
    assert cli.main(["merge", str(ds / "both"), str(ds / "t2i"), str(ds / "mine")]) == 0
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert warning == ("mmidx merge: warning: the output first (mmidx merge OUTPUT INPUT...) is deprecated and will "
                       f"be removed; name the output with -o/--output {ds / 'both'}")
    assert len(MMIDXDataset(ds / "both")) == len(MMIDXDataset(ds / "t2i")) + len(MMIDXDataset(ds / "mine"))


def test_build_refuses_a_dataset_that_no_report_describes_unless_forced(tmp_path, capsys):
    small_dataset(tmp_path / "out")  # a DatasetBuilder's dataset: no report says whose it is
    before = _files(tmp_path / "out")
    assert cli.main(build_command("text", tmp_path / "out")) == 1
    assert capsys.readouterr().err.strip() == (
        f"mmidx build: {tmp_path / 'out'} holds a dataset that is not the result of this build (no report beside it "
        "says so); pass --force to replace it, or choose another output")
    assert _files(tmp_path / "out") == before
    assert cli.main(build_command("text", tmp_path / "out", "--force")) == 0
    assert MMIDXDataset(tmp_path / "out").kind == "text" and report_path(tmp_path / "out").exists()


def test_mmidx_write_refuses_another_dataset_at_its_output(tmp_path):
    small_dataset(tmp_path / "out")
    before = _files(tmp_path / "out")
    with pytest.raises(BuildError, match="not the result of this build"):
        mmidx.write(_sample, range(3), tmp_path / "out", tokenizer=tokenizer_dir(), progress=False)
    assert _files(tmp_path / "out") == before
    assert mmidx.write(_sample, range(3), tmp_path / "out", tokenizer=tokenizer_dir(), progress=False,
                       force=True).ok


def test_a_builder_that_replaces_a_dataset_removes_the_report_that_described_it(built, tmp_path):
    ds = _copy(built, tmp_path, "t2i")
    small_dataset(ds / "t2i")  # DatasetBuilder replaces it (the Python API's writer, as documented)
    assert len(MMIDXDataset(ds / "t2i")) == 3 and not report_path(ds / "t2i").exists()


@pytest.mark.parametrize("argv", [build_command("text", "{tmp}/bad/"), build_command("text", "{tmp}/bad/.idx"),
                                  ["merge", "{tmp}/in", "--output", "{tmp}/bad/"]])
def test_an_output_prefix_that_names_a_folder_is_refused_saying_what_to_give(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as exit:
        cli.main([part.format(tmp=tmp_path) for part in argv])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"did you mean --output {tmp_path / 'bad'}/NAME?")
    assert list(tmp_path.iterdir()) == []  # nothing written: no hidden bad/.idx, bad/.bin...


def test_the_python_writers_refuse_a_prefix_that_names_a_folder(tmp_path):
    small_dataset(tmp_path / "in" / "ds")
    folder = str(tmp_path / "out") + "/"
    meant = f"{tmp_path / 'out'}/NAME"
    with pytest.raises(PrefixError, match=f"did you mean output='{meant}'"):
        mmidx.write(_sample, range(3), folder, tokenizer=tokenizer_dir(), progress=False)
    with pytest.raises(PrefixError, match=f"did you mean output='{meant}'"):
        merge_into(folder, [tmp_path / "in" / "ds"])
    with pytest.raises(PrefixError, match=f"did you mean prefix='{meant}'"):
        merge_datasets([tmp_path / "in" / "ds"], folder)
    with pytest.raises(PrefixError, match=f"did you mean prefix='{meant}'"):
        DatasetBuilder(folder, vocab_size=100)
    assert not (tmp_path / "out").exists()
