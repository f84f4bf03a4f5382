"""The Ray engine: the same files and report as a local build, retries of killed workers, resumption.

One real local Ray cluster (``ray.init(num_cpus=2)``) is started once per test session (``cluster`` in conftest.py).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from support.build_cases import build_command, same_dataset_files
from support.sources import image_bytes, tokenizer_dir, write_jsonl, write_t2i_parquet

from mmidx import cli
from mmidx.ingest import BuildOptions, build_dataset, report_path
from mmidx.sources import SourceOptions

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def many_rows(tmp_path_factory):
    """Six units of 150 rows each: slow enough to kill a worker or the driver in the middle."""
    folder = tmp_path_factory.mktemp("many")
    images = [image_bytes(24, 16, "RGB", "PNG", seed=i) for i in range(900)]
    return write_t2i_parquet(folder / "many.parquet", images, [{"0": f"a photo number {i}"} for i in range(900)],
                             150)


def _build(inputs, output, engine, **settings):
    return build_dataset(BuildOptions("t2i", (inputs,), tokenizer_dir(), str(output), SourceOptions(views=1),
                                      engine=engine, progress=False, **settings))


def _counts(data):
    return {key: value for key, value in data.items() if key not in ("seconds", "output")}


@pytest.mark.parametrize("source", ["t2i", "edit", "vlm", "text"])
def test_a_ray_build_writes_the_files_and_report_of_a_local_build(cluster, source, tmp_path):
    assert cli.main(build_command(source, tmp_path / "local" / "out")) == 0
    assert cli.main(build_command(source, tmp_path / "ray" / "out", "--engine", "ray")) == 0
    assert same_dataset_files(tmp_path / "local" / "out", tmp_path / "ray" / "out")
    local, remote = (json.loads(report_path(tmp_path / name / "out").read_text()) for name in ("local", "ray"))
    assert local["units"] >= 3 and _counts(local) == _counts(remote)


def test_bad_input_gives_the_same_skips_report_and_exit_status_on_ray(cluster, tmp_path, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "" if i % 4 == 1 else f"doc {i}"} for i in range(12)]
                       + ["{not json"])
    outputs = {}
    for engine in ("local", "ray"):
        command = ["build", "--source", "text", "--input", path, "--tokenizer", tokenizer_dir(), "--quiet",
                   "--output", str(tmp_path / engine / "out"), "--bytes-per-shard", "40", "--engine", engine]
        assert cli.main(command) == 1  # 4 of 13 rows skipped, more than the default 1 %
        outputs[engine] = capsys.readouterr().out
    local, remote = (json.loads(report_path(tmp_path / name / "out").read_text()) for name in ("local", "ray"))
    assert local["skips"]["empty_text"]["count"] == 3 and local["skips"]["invalid_json"]["count"] == 1
    assert _counts(local) == _counts(remote)
    assert [line for line in outputs["local"].splitlines()[1:]] == [line for line in outputs["ray"].splitlines()[1:]]


def test_a_ray_worker_killed_mid_task_is_retried_and_the_output_is_byte_identical(cluster, many_rows, tmp_path):
    _build(many_rows, tmp_path / "local" / "out", "local")
    result = {}
    builder = threading.Thread(target=lambda: result.update(report=_build(many_rows, tmp_path / "ray" / "out", "ray")))
    builder.start()
    shards, killed = tmp_path / "ray" / "out.shards", None
    deadline = time.monotonic() + 240
    while killed is None and builder.is_alive() and time.monotonic() < deadline:
        for attempt in shards.glob("*.attempt-*") if shards.exists() else []:
            pid = int(attempt.name.split(".attempt-")[1].split("-")[0])
            os.kill(pid, signal.SIGKILL)  # the Ray worker process running this task
            killed = pid
            break
        time.sleep(0.001)
    builder.join(120)
    assert killed is not None, "no task was caught running"
    assert not os.path.exists(f"/proc/{killed}/cmdline") or open(f"/proc/{killed}/stat").read().split()[2] == "Z"
    assert result["report"].ok and result["report"].data["rows"] == 900
    assert same_dataset_files(tmp_path / "local" / "out", tmp_path / "ray" / "out")


def test_a_killed_ray_driver_is_resumed_from_every_finished_shard(cluster, many_rows, tmp_path):
    _build(many_rows, tmp_path / "local" / "out", "local")
    command = [sys.executable, "-m", "mmidx.cli", "build", "--source", "t2i", "--input", many_rows, "--views", "1",
               "--tokenizer", tokenizer_dir(), "--output", str(tmp_path / "ray" / "out"), "--quiet",
               "--engine", "ray", "--ray-address", cluster]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shards = tmp_path / "ray" / "out.shards"
    deadline = time.monotonic() + 240  # a new driver joins the cluster slowly on a loaded machine
    while not list(shards.glob("?????/report.json")) and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert driver.poll() is None, f"the build ended (exit {driver.returncode}) before it could be killed"
    assert list(shards.glob("?????/report.json")), "no shard was finished in time"
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    time.sleep(1)  # the cluster stops the dead driver's tasks
    finished = len(list(shards.glob("?????/report.json")))
    assert 1 <= finished < 6
    report = _build(many_rows, tmp_path / "ray" / "out", "ray")
    assert report.ok and report.data["reused_units"] >= finished
    assert same_dataset_files(tmp_path / "local" / "out", tmp_path / "ray" / "out")


@pytest.mark.timeout(900)  # over half the default: a Ray job beside a local run: 159 s at a load of 20
def test_a_ray_precache_writes_the_streams_of_a_local_one(cluster, tmp_path):
    """Encoder actors on the cluster, batches written by the driver in order: byte-identical streams."""
    from support.precache import VAE, make_datasets

    from mmidx import format as fmt
    from mmidx.encodings.encode import Job
    from mmidx.encodings.precache import precache_dataset

    make_datasets(tmp_path)
    prefix = str(tmp_path / "edit")
    streams, records = {}, {}
    for engine in ("local", "ray"):
        job = Job(f"v_{engine}", "support.encoders:vae", batch_size=1)
        meta = precache_dataset(prefix, job, VAE, progress=False, engine=engine, workers=2, ray_address=cluster)
        records[engine] = meta["counts"]["records"]
        streams[engine] = {role: fmt.encoding_path(prefix, job.name, role).read_bytes() for role in ("bin", "idx")}
    assert records == {"local": 8, "ray": 8}  # 4 samples x 2 VAE images, one batch each
    assert streams["ray"] == streams["local"]
    with pytest.raises(ValueError, match="cannot import it"):  # the actor's own error, not Ray's wrapper
        precache_dataset(prefix, Job("v_bad", "support.encoders:missing"), VAE, progress=False, engine="ray",
                         ray_address=cluster)


def _session_processes(driver_pid):
    """Live processes whose command line names the Ray session a driver of this pid started."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"_{driver_pid}/".encode() in command and b"/session_" in command and state != "Z":
            found.append(command.split(b"\0")[0].decode(errors="replace"))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_local_cluster_started_by_a_killed_build_goes_with_it(tmp_path):
    """Ray's own processes notice a dead driver 10-15 s later; the reaper ends them at once."""
    rows = write_jsonl(tmp_path / "docs.jsonl", [{"text": "a few words " * (1 + i % 9)} for i in range(4000)])
    command = [sys.executable, "-m", "mmidx.cli", "build", "--source", "text", "--input", rows, "--tokenizer",
               tokenizer_dir(), "--output", str(tmp_path / "out"), "--bytes-per-shard", "4000", "--quiet",
               "--engine", "ray", "--workers", "2"]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (any("raylet" in p for p in _session_processes(driver.pid)) and (tmp_path / "out.shards").exists()):
        assert driver.poll() is None and time.monotonic() < deadline, "the build's cluster did not start in time"
        time.sleep(0.1)
    started = _session_processes(driver.pid)
    assert any("gcs_server" in p for p in started) and len(started) >= 3
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 5
    while _session_processes(driver.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_processes(driver.pid) == []
