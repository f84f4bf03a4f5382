"""Builder faults end cleanly: one line and exit 1, nothing partial, nothing that opens, no surviving worker."""

import errno
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from support.build_cases import same_dataset_files
from support.sources import image_bytes, tokenizer_dir, write_jsonl, write_parquet, write_t2i_parquet

import mmidx.ingest.writer
from mmidx import cli
from mmidx.format import FormatError
from mmidx.io.lock import output_lock
from mmidx.read.dataset import MMIDXDataset


@pytest.fixture(scope="module")
def t2i_input(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t2i")
    images = [image_bytes(40, 32, "RGB", "PNG", seed=i) for i in range(24)]
    return write_t2i_parquet(folder / "a.parquet", images, [{"0": f"picture {i}"} for i in range(24)], 4)


def _build(inputs, output, *extra, source="t2i"):
    return cli.main(["build", "--source", source, "--input", *inputs, "--tokenizer", tokenizer_dir(),
                     "--output", str(output), "--quiet", "--views", "1", "--rows-per-shard", "4", *extra])


def _assert_clean_failure(code, capsys, tmp_path, output, *expected):
    """Exit 1, one line on stderr naming what is expected, no partial file, nothing that opens."""
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert all(text in err for text in expected), err
    assert not [path for path in tmp_path.rglob("*") if ".partial" in path.name]
    with pytest.raises((FormatError, OSError)):
        MMIDXDataset(output)


def _descendants(pid):
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


def _running(argument):
    """Live processes (not zombies) whose command line holds ``argument``: a build and the workers it forked."""
    found = []
    for folder in Path("/proc").glob("[0-9]*"):
        try:
            command = (folder / "cmdline").read_bytes().split(b"\0")
            state = (folder / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if argument.encode() in command and state != "Z":
            found.append(int(folder.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_a_killed_build_and_the_rerun_is_byte_identical(t2i_input, tmp_path):
    assert _build([t2i_input], tmp_path / "once" / "out") == 0
    output = tmp_path / "killed" / "out"
    command = [sys.executable, "-m", "mmidx.cli", "build", "--source", "t2i", "--input", t2i_input, "--views", "1",
               "--tokenizer", tokenizer_dir(), "--output", str(output), "--rows-per-shard", "1", "--workers", "2",
               "--quiet"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    build = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not list(Path(f"{output}.shards").glob("?????/report.json")) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert _descendants(build.pid), "the build had no worker processes when it was killed"
    build.send_signal(signal.SIGKILL)  # the build alone, not its process group
    build.wait()
    # Every process running this build's command line, a worker forked after the look above included.
    deadline = time.monotonic() + 10
    while _running(str(output)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(str(output)), "a worker survived its build"
    assert _build([t2i_input], output) == 0
    assert same_dataset_files(tmp_path / "once" / "out", output)


def test_a_rerun_finishes_the_cleanup_a_killed_build_left(t2i_input, tmp_path, capsys):
    assert _build([t2i_input], tmp_path / "out") == 0
    leftover = tmp_path / "out.shards" / "00003"  # as if killed while deleting the shards
    leftover.mkdir(parents=True)
    (leftover / "report.json").write_text("{}")
    assert _build([t2i_input], tmp_path / "out") == 0
    assert "already built" in capsys.readouterr().out
    assert not (tmp_path / "out.shards").exists()


class _FullDisk(io.RawIOBase):
    """A file on a disk that fills up after ``room`` bytes (the kernel's ENOSPC names no file)."""

    def __init__(self, path, room):
        self.file, self.room = open(path, "wb", buffering=0), room

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)

    def fileno(self):
        return self.file.fileno()

    def close(self):
        self.file.close()
        super().close()


@pytest.mark.parametrize("where", ["shard", "merge"])
def test_a_full_disk_ends_in_one_line_naming_the_file(t2i_input, tmp_path, capsys, monkeypatch, where):
    real_open = open

    def disk_open(path, mode="r", buffering=-1, **kwargs):
        full = where == "merge" if ".shards" not in str(path) else where == "shard"
        if "w" in mode and full:
            return io.BufferedWriter(_FullDisk(path, 1000), buffer_size=max(buffering, 1 << 16))
        return real_open(path, mode, buffering, **kwargs)

    monkeypatch.setattr(mmidx.ingest.writer, "open", disk_open, raising=False)
    code = _build([t2i_input], tmp_path / "out")
    _assert_clean_failure(code, capsys, tmp_path, tmp_path / "out", "No space left on device", ".partial")


@pytest.mark.parametrize(("call", "error"), [("open", errno.EROFS), ("mkdir", errno.EACCES)])
def test_a_read_only_or_forbidden_output_ends_in_one_line(t2i_input, tmp_path, capsys, monkeypatch, call, error):
    real = getattr(os, call)
    refused = tmp_path / "refused"
    refused.mkdir()

    def refuse(path, *args, **kwargs):  # what a read-only mount or a folder of another user answers, even to root
        if str(path).startswith(str(refused)):
            raise OSError(error, os.strerror(error), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, call, refuse)
    code = _build([t2i_input], refused / "out")
    monkeypatch.undo()
    _assert_clean_failure(code, capsys, tmp_path, refused / "out", str(refused), os.strerror(error))


def test_an_output_under_a_regular_file_ends_in_one_line(t2i_input, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    code = _build([t2i_input], tmp_path / "file" / "out")
    _assert_clean_failure(code, capsys, tmp_path, tmp_path / "file" / "out", str(tmp_path / "file"))


def test_a_second_build_of_one_output_refuses_at_once_naming_the_holder(t2i_input, tmp_path, capsys):
    with output_lock(tmp_path / "out"):
        started = time.monotonic()
        code = _build([t2i_input], tmp_path / "out")
        assert time.monotonic() - started < 10
    _assert_clean_failure(code, capsys, tmp_path, tmp_path / "out", f"pid {os.getpid()}",
                          f"host {socket.gethostname()}")
    assert not (tmp_path / "out.lock").exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over(t2i_input, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "out.lock").write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    assert _build([t2i_input], tmp_path / "out") == 0
    assert len(MMIDXDataset(tmp_path / "out")) == 24 and not (tmp_path / "out.lock").exists()


def test_a_rerun_is_judged_by_the_skip_rate_limit_given_now(tmp_path, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "" if i < 2 else f"doc {i}"} for i in range(10)])
    assert _build([path], tmp_path / "out", source="text") == 1
    assert "more than --max-skip-rate 1.00%" in capsys.readouterr().out
    assert _build([path], tmp_path / "out", "--max-skip-rate", "0.2", source="text") == 0
    assert "already built: skipped 20.00% of the rows (limit 20.00%)" in capsys.readouterr().out


def test_the_build_summary_counts_in_the_right_number(tmp_path, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "one document"}])
    assert _build([path], tmp_path / "out", source="text") == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "1 sample (1 view, 0 images, " in first and "from 1 row in" in first and first.endswith("; 1 unit, 0 reused")


def test_replacing_a_dataset_built_with_other_options_needs_force(t2i_input, tmp_path, capsys):
    assert _build([t2i_input], tmp_path / "out") == 0
    before = {path.name: path.read_bytes() for path in tmp_path.glob("out.*")}
    capsys.readouterr()
    assert _build([t2i_input], tmp_path / "out", "--views", "2") == 1
    assert capsys.readouterr().err.strip() == (
        f"mmidx build: {tmp_path / 'out'} holds a dataset built from other inputs or options (see "
        f"{tmp_path / 'out.report.json'}); pass --force to replace it, or choose another output")
    assert {path.name: path.read_bytes() for path in tmp_path.glob("out.*")} == before  # untouched
    assert _build([t2i_input], tmp_path / "out", "--views", "2", "--force") == 0
    assert MMIDXDataset(tmp_path / "out")[0].num_views == 2
    assert _build([t2i_input], tmp_path / "out", "--views", "2") == 0  # the same options: reused, no --force
    assert "already built" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["empty parquet", "wrong JSON key"])
def test_a_build_without_samples_leaves_nothing_that_opens(t2i_input, tmp_path, capsys, case):
    assert _build([t2i_input], tmp_path / "out") == 0  # an old dataset at the output goes too
    capsys.readouterr()
    if case == "empty parquet":
        path = write_parquet(tmp_path / "empty.parquet", {"image": [], "captions": []},
                             {"image": pa.binary(), "captions": pa.string()}, 4)
        code = _build([path], tmp_path / "out", "--force")
    else:
        path = write_jsonl(tmp_path / "docs.jsonl", [{"content": f"doc {i}"} for i in range(5)])
        code = _build([path], tmp_path / "out", "--max-skip-rate", "1", "--force", source="text")
    out = capsys.readouterr().out
    assert code == 1 and sum("FAILED" in line for line in out.splitlines()) == 1
    assert "no dataset was written" in out
    with pytest.raises(FormatError):
        MMIDXDataset(tmp_path / "out")
    assert not [p for p in tmp_path.glob("out.*") if p.suffix in (".bin", ".idx", ".images", ".plan")]


def test_llava_rows_whose_image_placeholders_differ_from_their_images_are_counted_as_warnings(tmp_path):
    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes(image_bytes(16, 16, "RGB", "PNG"))
    answer = {"from": "gpt", "value": "ok"}
    rows = [{"image": "a.png", "conversations": [{"from": "human", "value": "<image> one"}, answer]},
            {"image": ["a.png", "b.png"], "conversations": [{"from": "human", "value": "<image> two"}, answer]},
            {"image": "a.png", "conversations": [{"from": "human", "value": "<image><image> x"}, answer]}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    assert _build([path], tmp_path / "out", source="vlm") == 0
    report = json.loads((tmp_path / "out.report.json").read_text())
    entry = report["warnings"]["image_placeholder_mismatch"]
    assert report["samples"] == 3 and report["skipped"] == 0 and report["warned"] == 2
    assert entry["count"] == 2 and [e["line"] for e in entry["examples"]] == [2, 3]
    assert entry["examples"][0]["detail"] == "1 <image> placeholder(s) for 2 image(s)"


def test_a_truncated_image_of_a_vlm_row_is_reported_naming_the_image_and_the_line(tmp_path, capsys):
    good = image_bytes(32, 32, "RGB", "JPEG")
    (tmp_path / "good.jpg").write_bytes(good)
    (tmp_path / "cut.jpg").write_bytes(good[: len(good) // 2])
    turns = [{"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "this"}]
    path = write_jsonl(tmp_path / "sft.jsonl", [{"image": name, "conversations": turns}
                                                for name in ("good.jpg", "good.jpg", "cut.jpg")])
    assert _build([path], tmp_path / "out", "--max-skip-rate", "0.5", source="vlm") == 0
    example = json.loads((tmp_path / "out.report.json").read_text())["skips"]["undecodable_image"]["examples"][0]
    assert example["file"] == path and example["line"] == 3 and str(tmp_path / "cut.jpg") in example["detail"]
    assert f"{path} line 3: {tmp_path / 'cut.jpg'}" in capsys.readouterr().out


def test_a_missing_ray_says_how_to_install_it(t2i_input, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    code = _build([t2i_input], tmp_path / "out", "--engine", "ray")
    _assert_clean_failure(code, capsys, tmp_path, tmp_path / "out", 'pip install "mmidx[ray]"')
