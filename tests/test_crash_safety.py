"""An interrupted build never leaves files that open as a dataset, and never damages an old one."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from support.helpers import assert_sample_equal, small_dataset

import mmidx.ingest.writer
from mmidx.format import FormatError
from mmidx.ingest.writer import DatasetBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources.elements import Element


def _fail_after(count):
    real = os.replace
    calls = []

    def replace(src, dst):
        if len(calls) == count:
            raise OSError("simulated crash")
        calls.append(dst)
        real(src, dst)
    return replace


@pytest.mark.parametrize("renames_before_crash", range(5))
def test_a_crash_between_renames_leaves_nothing_that_opens(tmp_path, monkeypatch, renames_before_crash):
    monkeypatch.setattr(mmidx.ingest.writer.os, "replace", _fail_after(renames_before_crash))
    with pytest.raises(OSError, match="simulated crash"):
        small_dataset(tmp_path / "ds")
    with pytest.raises(FormatError):
        MMIDXDataset(tmp_path / "ds")
    import megatron.core.datasets.indexed_dataset as megatron
    assert not megatron.IndexedDataset.exists(str(tmp_path / "ds"))


def test_a_crash_while_rebuilding_does_not_leave_old_and_new_files_mixed(tmp_path, monkeypatch):
    small_dataset(tmp_path / "ds", seed=1)
    monkeypatch.setattr(mmidx.ingest.writer.os, "replace", _fail_after(2))
    with pytest.raises(OSError):
        small_dataset(tmp_path / "ds", seed=2, count=5)
    with pytest.raises(FormatError):
        MMIDXDataset(tmp_path / "ds")


def test_an_exception_inside_the_builder_removes_partial_files(tmp_path):
    with pytest.raises(RuntimeError), DatasetBuilder(tmp_path / "ds", vocab_size=10) as builder:
        builder.add_sample([[1]], [], [[Element("text", 0)]])
        raise RuntimeError("source failed")
    assert list(tmp_path.iterdir()) == []


def test_kill_9_mid_build_then_rebuild(tmp_path):
    script = textwrap.dedent(f"""
        from mmidx.ingest.writer import DatasetBuilder, Element
        with DatasetBuilder({str(tmp_path / "ds")!r}, vocab_size=100) as builder:
            for i in range(10**9):
                builder.add_sample([[1, 2, 3]], [], [[Element("text", 0)]])
                if i == 1000:
                    print("building", flush=True)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert process.stdout.readline().strip() == b"building"
    time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert any(path.name.endswith(".partial") for path in tmp_path.iterdir())
    with pytest.raises(FormatError):
        MMIDXDataset(tmp_path / "ds")
    samples = small_dataset(tmp_path / "ds")
    dataset = MMIDXDataset(tmp_path / "ds")
    for i, raw in enumerate(samples):
        assert_sample_equal(dataset[i], raw)
    assert not any(path.name.endswith(".partial") for path in tmp_path.iterdir())


def test_a_rerun_removes_the_report_partial_a_killed_build_left_but_not_a_live_writers(tmp_path):
    from support.sources import build, write_jsonl

    from mmidx.ingest.report import report_path

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # a process that has ended: kill -9 mid-write leaves a partial like its
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        report = report_path(tmp_path / "out")
        killed = report.with_name(f"{report.name}.{dead_pid}-0a1b2c3d.partial")
        running = report.with_name(f"{report.name}.{live.pid}-0a1b2c3d.partial")
        fresh = report.with_name(f"{report.name}.{dead_pid}-ffffffff.partial")  # maybe another node's, writing
        for path in (killed, running, fresh):
            path.write_text("{")
        for path in (killed, running):
            os.utime(path, (time.time() - 3600, time.time() - 3600))
        build("text", [write_jsonl(tmp_path / "docs.jsonl", [{"text": "one"}, {"text": "two"}])], tmp_path / "out")
        assert report.exists() and not killed.exists() and running.exists() and fresh.exists()
    finally:
        live.kill()
        live.wait()
