"""The benchmark scripts start, and their shared protocol (benchmarks/common.py) does what it promises.

The scripts themselves are not run here (timings are never tests); each is started with ``--help``, which
imports everything it uses, so a module that moves under them fails here and not in front of a reader.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from common import Watch, interleave, ratio  # noqa: E402

LIBRARIES = {"common.py", "gpu_step.py"}  # modules the scripts import, not scripts
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("*.py") if path.name not in LIBRARIES)


def test_every_benchmark_script_starts_and_prints_its_help():
    # one interpreter for all scripts: each is run as __main__ with --help, which exits 0 after its imports
    program = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "failed = []\n"
        f"for name in {SCRIPTS!r}:\n"
        "    sys.argv = [name, '--help']\n"
        "    try:\n"
        f"        runpy.run_path({str(BENCHMARKS)!r} + '/' + name, run_name='__main__')\n"
        "    except SystemExit as exit:\n"
        "        if exit.code not in (0, None):\n"
        "            failed.append((name, exit.code))\n"
        "    except Exception as error:\n"
        "        failed.append((name, repr(error)))\n"
        "    else:\n"
        "        failed.append((name, 'ran without --help handling'))\n"
        "print('FAILED', failed)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                          cwd=BENCHMARKS)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("FAILED []"), done.stdout[-2000:]
    assert len(SCRIPTS) >= 10


def test_sides_take_turns_with_the_first_side_rotating():
    calls = []
    sides = {name: (lambda item, name=name: calls.append((name, item))) for name in ("a", "b", "c")}
    turns = interleave(sides, ["x", "y"], rounds=2)
    assert calls == [("a", "x"), ("b", "x"), ("c", "x"), ("b", "y"), ("c", "y"), ("a", "y"),
                     ("b", "x"), ("c", "x"), ("a", "x"), ("c", "y"), ("a", "y"), ("b", "y")]
    assert [len(per_round) for per_round in turns.cpu["a"]] == [2, 2]
    assert len(turns.per_round("b", "wall")) == 2


def test_interleaved_cpu_time_is_charged_to_the_side_that_spent_it():
    def spin(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    turns = interleave({"slow": lambda _: spin(0.03), "fast": lambda _: spin(0.003)}, range(3), rounds=2)
    slow, fast = turns.per_round("slow"), turns.per_round("fast")
    assert all(s >= 0.09 for s in slow) and all(f < 0.05 for f in fast)


def test_ratio_is_the_median_over_rounds_with_its_range():
    result = ratio([30.0, 10.0, 20.0, 40.0], [10.0, 10.0, 10.0, 10.0])
    assert (result.median, result.low, result.high, result.rounds) == (2.5, 1.0, 4.0, 4)
    assert str(result) == "2.50× (1.00–4.00 over 4 rounds)"
    with pytest.raises(ValueError):
        ratio([1.0], [])


def _counters(*values):
    readings = iter(values)
    return lambda: next(readings)


def test_a_run_where_other_processes_used_little_cpu_is_quiet():
    # the machine was busy 3.2 CPU-seconds, 3.0 of them this benchmark's own: 0.2 s over a ~1 s run
    with Watch(busy=_counters(100.0, 103.2), own=_counters(5.0, 8.0)) as watch:
        time.sleep(1.0)
    assert 0.1 < watch.other_cores < 0.25
    assert not watch.noisy
    assert watch.headline("3.4× BAGEL") == "3.4× BAGEL"
    assert "quiet" in watch.describe() and "load average" in watch.describe()


def test_a_run_beside_a_busy_process_is_noisy_and_withholds_its_headline():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)  # let it start spinning
        with Watch() as watch:
            time.sleep(1.5)
    finally:
        busy.kill()
        busy.wait()
    assert watch.other_cores > 0.5, watch.describe()
    assert watch.noisy
    assert watch.headline("3.4× BAGEL") == "noisy: rerun on a quiet machine"
    assert watch.describe().endswith("noisy: rerun on a quiet machine")
