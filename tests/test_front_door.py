"""A new user's small gaps (issue 56, item 17): inputs that would run for hours are refused at once in one line,
``file://`` prefixes work where any URI pyarrow opens is promised, and the lines a command ends in say what is
there (a folder's datasets, a cache folder that does not exist); the inspecting page says that a ``mmidx.write``
dataset is not exported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import small_dataset
from support.sources import image_bytes, tokenizer_dir, write_t2i_parquet

import mmidx
from mmidx.cli import main
from mmidx.config import DataConfig
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources import SourceOptions


def run(argv, capsys):
    """(exit status, stdout, stderr lines) of one command."""
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


@pytest.fixture(scope="module")
def t2i_rows(tmp_path_factory):
    """A t2i parquet of 4 rows."""
    path = tmp_path_factory.mktemp("rows") / "rows.parquet"
    write_t2i_parquet(path, [image_bytes(40, 32, seed=i) for i in range(4)], [{"a": f"picture {i}"} for i in range(4)],
                      2)
    return path


def test_views_past_the_bound_are_refused_before_any_work(t2i_rows, tmp_path, capsys):
    assert SourceOptions(views=1024).views == 1024  # mmidx.sources.MAX_VIEWS, as docs/guide/building.md says
    for views in (1025, 1_000_000):
        with pytest.raises(ValueError, match=f"views must lie in 1..1,024, not {views:,}: epoch e reads view e mod"):
            SourceOptions(views=views)
    code, _, lines = run(["build", "--source", "t2i", "--input", t2i_rows, "--tokenizer", tokenizer_dir(), "--output",
                          tmp_path / "out", "--views", "1000000", "--quiet"], capsys)
    assert code == 1 and len(lines) == 1 and lines[0].startswith("mmidx build: views must lie in 1..1,024")
    assert not os.listdir(tmp_path)  # nothing was built


def index_command(*argv):
    """``mmidx index`` in a child process, bounded in time (before the bound it ran for hours)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(mmidx.__file__).parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "mmidx.cli", "index", *map(str, argv)], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("cached", [False, True])
def test_a_num_samples_whose_index_cannot_fit_is_refused_at_once_in_one_line(demo, tmp_path, cached):
    """10^15 samples: at least 1 PB of index (a byte a sample at least), more than any memory or disk here."""
    yaml = f"{demo['workdir']}/datasets/data.yaml"
    result = index_command(yaml, "--num-samples", 10**15, *(["--cache-dir", tmp_path / "cache"] if cached else []))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    where = f"free on the disk of {tmp_path / 'cache'}" if cached else "memory this machine has available"
    assert lines[0].startswith("mmidx index: a pack index of 1,000,000,000,000,000 samples (about ")
    assert where in lines[0] and "--num-samples counts the samples drawn, not tokens or steps" in lines[0]
    assert not cached or os.listdir(tmp_path / "cache") == []  # no partial entry left behind
    fits = index_command(yaml, "--num-samples", 1000)  # the bound leaves ordinary lengths alone
    assert fits.returncode == 0 and "samples 1,000" in fits.stdout, fits.stderr


def test_gpt_samples_beyond_any_memory_are_one_line_naming_the_option(tmp_path, capsys):
    from mmidx.ingest.writer import DatasetBuilder

    with DatasetBuilder(tmp_path / "text", kind="text", vocab_size=100, special_tokens={"eod": 0}) as builder:
        for length in (5, 9, 3):
            builder.add_document([[*range(1, length), 0]])
        builder.finalize()
    code, _, lines = run(["index", "--gpt", tmp_path / "text", "--seq-length", 4, "--num-samples", 10**15], capsys)
    assert code == 1 and len(lines) == 1 and "internal error" not in lines[0]
    assert lines[0].endswith("ask for fewer (--num-samples)") and "GPT samples of 4 tokens need more memory" in lines[0]


def test_file_uris_are_prefixes_and_data_yamls_wherever_paths_are(demo, t2i_rows, tmp_path, capsys):
    datasets = Path(demo["workdir"]) / "datasets"
    prefix = datasets / "t2i_pretrain" / "t2i"
    uri = f"file://{prefix}"
    assert MMIDXDataset(uri).prefix == str(prefix) and MMIDXDataset(uri).checksum == MMIDXDataset(prefix).checksum
    config = DataConfig.from_yaml(f"file://{datasets / 'data.yaml'}")
    assert config == DataConfig.from_yaml(datasets / "data.yaml")
    code, out, _ = run(["inspect", uri], capsys)
    assert code == 0 and out.startswith(f"mmidx dataset {prefix}  (")
    code, out, _ = run(["index", f"file://{datasets / 'data.yaml'}"], capsys)
    assert code == 0 and "samples 40" in out
    output = tmp_path / "built" / "t2i"
    code, _, _ = run(["build", "--source", "t2i", "--input", t2i_rows, "--tokenizer", tokenizer_dir(), "--output",
                      f"file://{output}", "--quiet"], capsys)
    assert code == 0 and len(MMIDXDataset(output)) == 4  # at the path the URI names, not under ./file:


def test_inspect_and_verify_of_a_folder_name_the_datasets_in_it(demo, tmp_path, capsys):
    datasets = Path(demo["workdir"]) / "datasets"
    for command in ("inspect", "verify"):
        code, _, lines = run([command, datasets], capsys)
        assert code == 1 and lines == [
            f"mmidx {command}: {datasets} is a folder, not a dataset; give one of the datasets in it: "
            f"{datasets}/t2i_pretrain/t2i, {datasets}/unified_edit/seedxedit_multi, {datasets}/vlm_sft/llava_ov "
            f"(or a data YAML: {datasets}/data.yaml)"]
    small_dataset(tmp_path / "one" / "ds")
    (tmp_path / "one" / "ds.enc.vae.idx").write_bytes(b"")  # a precached encoding's file is not a dataset
    (tmp_path / "one" / "ds.enc.vae.bin").write_bytes(b"")
    code, _, lines = run(["inspect", tmp_path / "one"], capsys)
    assert code == 1 and lines[0].endswith(f"give one of the datasets in it: {tmp_path}/one/ds")
    (tmp_path / "none").mkdir()
    code, _, lines = run(["inspect", tmp_path / "none"], capsys)
    assert code == 1 and lines == [f"mmidx inspect: {tmp_path}/none is a folder with no dataset in it; give a "
                                   "dataset's prefix (its files are PREFIX.idx, PREFIX.bin...)"]


@pytest.mark.parametrize("action", ["info", "clear"])
def test_cache_info_and_clear_of_a_folder_that_does_not_exist_say_so(action, tmp_path, capsys):
    code, out, lines = run(["cache", action, tmp_path / "missing"], capsys)
    assert code == 1 and out == "" and len(lines) == 1
    assert lines[0].startswith(f"mmidx cache: {tmp_path / 'missing'}: no such folder: give mmidx's cache folder")
    assert not (tmp_path / "missing").exists()


def test_export_of_a_dataset_mmidx_write_built_is_one_line_and_the_inspecting_page_says_so(tmp_path, capsys):
    def sample(i):
        return {"texts": [f"picture {i}"], "images": [image_bytes(32, 24, seed=i)],
                "views": [[mmidx.Element("text", 0), mmidx.Element("vae_image", 0, loss=True)]]}

    assert mmidx.write(sample, range(2), tmp_path / "ds", tokenizer=tokenizer_dir(), progress=False).ok
    for layout in ("parquet", "hf"):
        code, _, lines = run(["export", tmp_path / "ds", "--to", layout, "-o", tmp_path / layout], capsys)
        assert code == 1 and len(lines) == 1 and not (tmp_path / layout).exists()
        assert lines[0].startswith(f"mmidx export: {tmp_path}/ds: built by the function source; ")
    page = " ".join((Path(__file__).parents[1] / "docs" / "guide" / "inspecting.md").read_text().split())
    assert ("A dataset built with `mmidx.write` is not exported: its samples are what your function made of its "
            "inputs, which no raw layout holds and no `mmidx build` source rebuilds.") in page
