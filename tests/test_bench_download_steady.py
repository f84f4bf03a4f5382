"""bench_download's steady-state sample: the CPU of the tool's processes (and not of processes already running)
between 20% and 80% of the URLs the server saw, checked against a child process that burns a known CPU."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_download  # noqa: E402

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def _burn(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BURN.format(seconds=seconds)])


def test_descendants_counts_a_busy_child_and_what_its_own_child_spent():
    # the child waits for a grandchild that burns 0.4 s, then burns 0.3 s itself
    program = ("import subprocess, sys, time\n"
               f"subprocess.run([sys.executable, '-c', {BURN.format(seconds=0.4)!r}])\n"
               + BURN.format(seconds=0.3) + "time.sleep(5)\n")
    child = subprocess.Popen([sys.executable, "-c", program])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            cpu = bench_download.descendants().get(child.pid, 0.0)
            if cpu >= 0.7:
                break
            time.sleep(0.05)
        assert 0.7 <= cpu < 1.5
    finally:
        child.kill()
        child.wait()


class _FakeServer:
    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()


def test_the_steady_window_is_the_cpu_between_20_and_80_percent_of_the_urls():
    server = _FakeServer()
    sampler = bench_download.Sampler(server, every=1.0)
    # (distinct URLs seen, CPU seconds): 1 s of startup, then 0.01 s per URL, then 2 s of final writes
    sampler.samples = [(0, 0.5), (0, 1.0)] + [(urls, 1.0 + 0.01 * urls) for urls in range(0, 1001, 50)] + [
        (1000, 13.0)]
    server.requests.update(f"/image/a?row={row}" for row in range(1000))
    cpu, share = sampler.steady()
    assert share == 0.6 and abs(cpu - 6.0) < 1e-9  # 600 URLs at 0.01 s: startup and the end left out


def test_a_process_already_running_is_not_charged_to_the_next_run():
    leftover = _burn(3.0)  # an earlier tool's process, still busy
    try:
        time.sleep(0.2)
        server = _FakeServer()
        with bench_download.Sampler(server, every=0.05) as sampler:
            tool = _burn(0.3)
            for row in range(20):
                server.requests[f"/x?row={row}"] += 1
                time.sleep(0.03)
            tool.wait()
        measured = max(cpu for _, cpu in sampler.samples)
        assert 0.1 <= measured <= 0.5  # the tool's 0.3 s, not the leftover's seconds
    finally:
        leftover.kill()
        leftover.wait()
