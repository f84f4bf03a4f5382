"""An interrupted build never leaves files that open as a dataset, and never damages an old one."""

import json
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


def _ended_pid():
    """The pid of a process that has ended (as a writer killed with -9 has)."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def _report_partials(prefix):
    from mmidx.ingest.report import report_path

    report = report_path(prefix)
    return sorted(path.name for path in report.parent.glob(report.name + ".*.partial"))


KILL_AT_THE_REPORTS_RENAME = """
import json, os, signal, sys
from pathlib import Path
from mmidx import cli

real = os.replace
def replace(source, target):  # the build's report is on disk under its temporary name: die before the rename
    if Path(target).name.endswith(".report.json"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(source, target)
os.replace = replace
cli.main(json.loads(sys.argv[1]))
"""


def test_kill_9_during_the_reports_write_then_an_immediate_rerun_leaves_no_partial(tmp_path):
    from support.build_cases import build_command

    from mmidx import cli
    from mmidx.ingest.report import report_path

    output, command = tmp_path / "out", build_command("text", tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", KILL_AT_THE_REPORTS_RENAME, json.dumps(command)], env=env,
                            capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert len(_report_partials(output)) == 1 and not report_path(output).exists()  # what kill -9 left
    assert cli.main(command) == 0  # the same command at once: the partial is seconds old, its writer dead
    assert _report_partials(output) == [] and report_path(output).exists()
    assert MMIDXDataset(output).metadata["meta_sha256"] == json.loads(report_path(output).read_text())["meta_sha256"]


def test_a_rerun_that_finds_the_dataset_built_removes_every_partial_of_its_report(tmp_path):
    from support.build_cases import build_command

    from mmidx import cli
    from mmidx.ingest.report import report_path

    output = tmp_path / "out"
    assert cli.main(build_command("text", output)) == 0
    report = report_path(output)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # under the output's lock no writer of the report is alive: a pid now running is another process's
        for pid, age in ((_ended_pid(), 0), (_ended_pid(), 3600), (live.pid, 0)):
            partial = report.with_name(f"{report.name}.{pid}-0a1b2c3d.partial")
            partial.write_text("{")
            os.utime(partial, (time.time() - age, time.time() - age))
        assert len(_report_partials(output)) == 3
        assert cli.main(build_command("text", output)) == 0  # "already built": it still looks
        assert _report_partials(output) == []
    finally:
        live.kill()
        live.wait()


HOLD_THE_OUTPUT = """
import os, sys, time
from mmidx.io.lock import output_lock
from mmidx.ingest.report import report_path
with output_lock(sys.argv[1]):  # a build that is writing its report
    report = report_path(sys.argv[1])
    report.with_name(f"{report.name}.{os.getpid()}-0a1b2c3d.partial").write_text("{")
    print("writing", flush=True)
    time.sleep(60)
"""


def test_a_second_build_never_removes_the_partial_report_of_a_build_that_runs(tmp_path):
    from support.build_cases import build_command

    from mmidx import cli

    output = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writer = subprocess.Popen([sys.executable, "-c", HOLD_THE_OUTPUT, str(output)], env=env, stdout=subprocess.PIPE)
    try:
        assert writer.stdout.readline().strip() == b"writing"
        assert cli.main(build_command("text", output)) == 1  # refused: another build holds the output
        assert _report_partials(output) == [f"out.report.json.{writer.pid}-0a1b2c3d.partial"]
    finally:
        writer.kill()
        writer.wait()
