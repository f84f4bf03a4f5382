"""What every benchmark script shares: the machine's description, best-of-N timing, and the protocol that
keeps side-by-side figures honest on a shared machine.

The protocol: the sides take turns item by item (a pack, a read, a file) over several rounds, the side that
goes first rotating, so that whatever else the machine does falls on every side alike; each round gives one
ratio, and the headline is the median ratio with its spread over the rounds. A :class:`Watch` around the run
records the load average before and after, the commit, and how many cores *other* processes kept busy while
it ran (the machine's busy time from ``/proc/stat`` less this process's own). CPU time per side does not make
a loaded machine fair (a side heavy on memory bandwidth loses more to a shared cache), so past half a core of
other work the headline is withheld: :meth:`Watch.headline` prints "noisy: rerun on a quiet machine".
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmidx.toolkit.bench import machine

__all__ = ["Measured", "Ratio", "Turns", "Watch", "best_of", "commit", "interleave", "machine", "measure", "ratio"]

NOISY_CORES = 0.5  # other processes' CPU, in cores, past which a run's headline is withheld
REPO = Path(__file__).resolve().parent.parent


def best_of(function: Callable[[], Any], repeats: int, *, warmup: bool = False) -> tuple[float, Any]:
    """The fastest wall time, in seconds, of ``repeats`` calls, and the last call's result."""
    if warmup:
        function()
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def commit() -> str:
    """The checkout's short commit, with ``+changes`` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--"],
                               capture_output=True).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+changes" if dirty else "")


def _machine_busy_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process (all its threads) and of its children that have been waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class Watch:
    """What the machine was doing during a benchmark: load averages, and the cores other processes used.

    Use as ``with Watch() as watch: ...``, then :meth:`describe` for the line printed under the table and
    :meth:`headline` for each figure that should only be printed from a quiet run. ``busy`` and ``own`` (CPU
    seconds of the whole machine and of this benchmark) can be replaced, for tests.
    """

    def __init__(self, busy: Callable[[], float] = _machine_busy_seconds,
                 own: Callable[[], float] = _own_seconds) -> None:
        self._busy, self._own = busy, own
        self.load_before = self.load_after = 0.0
        self.other_cores = 0.0
        self.seconds = 0.0

    def __enter__(self) -> Watch:
        self.load_before = os.getloadavg()[0]
        self._start = (time.perf_counter(), self._busy(), self._own())
        return self

    def __exit__(self, *exc: object) -> None:
        wall, busy, own = (now - then for now, then in zip(
            (time.perf_counter(), self._busy(), self._own()), self._start, strict=True))
        self.load_after = os.getloadavg()[0]
        self.seconds = wall
        self.other_cores = max(0.0, busy - own) / wall if wall > 0 else 0.0

    @property
    def noisy(self) -> bool:
        """Whether other processes kept more than half a core busy on average during the run."""
        return self.other_cores > NOISY_CORES

    def describe(self) -> str:
        """One line for under a table: commit, load averages, other processes' cores, the verdict."""
        verdict = "noisy: rerun on a quiet machine" if self.noisy else "quiet"
        return (f"commit {commit()}; load average {self.load_before:.2f} before, {self.load_after:.2f} after (1 min); "
                f"other processes used {self.other_cores:.2f} of {os.cpu_count()} cores during the "
                f"{self.seconds:.0f} s run: {verdict}")

    def headline(self, text: str) -> str:
        """``text``, or the refusal to print it when the run was noisy."""
        return "noisy: rerun on a quiet machine" if self.noisy else text


@dataclass(frozen=True)
class Measured:
    """What one command cost: wall seconds, CPU seconds of its whole process tree, the tree's peak anonymous memory
    (the sum over its live processes of ``RssAnon``, sampled), and its exit status and output."""

    wall: float
    cpu: float
    peak_anon: int
    returncode: int
    output: str


def _tree(root: int) -> list[int]:
    """``root`` and every live descendant of it (from ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _anon_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(argv: Sequence[str], *, env: Mapping[str, str] | None = None, interval: float = 0.02,
            timeout: float | None = None, cwd: str | os.PathLike | None = None) -> Measured:
    """Run ``argv`` and measure it: wall time, the CPU time of it and its children (``wait4``'s rusage, which
    counts every descendant that was waited for), and the peak of its process tree's anonymous memory, polled
    every ``interval`` seconds (mapped files are not anonymous: a reader's maps are not counted as memory)."""
    started = time.perf_counter()
    process = subprocess.Popen(list(argv), env=None if env is None else dict(env), cwd=cwd,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak = 0
    chunks: list[bytes] = []
    os.set_blocking(process.stdout.fileno(), False)
    while True:
        waited = os.wait4(process.pid, os.WNOHANG)
        if waited[0] == process.pid:
            break
        peak = max(peak, sum(_anon_bytes(pid) for pid in _tree(process.pid)))
        if (data := process.stdout.read()) is not None:
            chunks.append(data)
        if timeout is not None and time.perf_counter() - started > timeout:
            process.kill()
        time.sleep(interval)
    wall = time.perf_counter() - started
    _, status, usage = waited
    process.returncode = os.waitstatus_to_exitcode(status)
    os.set_blocking(process.stdout.fileno(), True)
    chunks.append(process.stdout.read())
    return Measured(wall, usage.ru_utime + usage.ru_stime, peak, process.returncode,
                    b"".join(chunks).decode(errors="replace"))


@dataclass
class Turns:
    """Seconds each side took for each item in each round: ``cpu`` (all threads of this process) and ``wall``."""

    cpu: dict[str, list[list[float]]]
    wall: dict[str, list[list[float]]]
    results: dict[str, list[Any]]  # each side's result per item, from the last round

    def per_round(self, side: str, clock: str = "cpu") -> list[float]:
        """The side's total seconds in each round."""
        return [sum(round_) for round_ in getattr(self, clock)[side]]


def interleave(sides: Mapping[str, Callable[[Any], Any]], items: Sequence[Any], rounds: int) -> Turns:
    """Run every side on every item, taking turns item by item, for ``rounds`` rounds.

    The side that goes first rotates with the item and the round, so no side always meets a warm (or a
    cold) cache left by the other. The items are the same objects on every side and round. Each side's
    results of the current round are kept (:attr:`Turns.results`): a side should return something small,
    not a batch whose buffers would then stay alive, and not be reused, until the round ends.
    """
    names = list(sides)
    cpu = {name: [] for name in names}
    wall = {name: [] for name in names}
    results: dict[str, list[Any]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names:
            cpu[name].append([])
            wall[name].append([])
            results[name] = []
        for index, item in enumerate(items):
            shift = (round_ + index) % len(names)
            for name in names[shift:] + names[:shift]:
                start_cpu, start_wall = time.process_time(), time.perf_counter()
                result = sides[name](item)
                cpu[name][-1].append(time.process_time() - start_cpu)
                wall[name][-1].append(time.perf_counter() - start_wall)
                results[name].append(result)
    return Turns(cpu, wall, results)


@dataclass(frozen=True)
class Ratio:
    """A median ratio over rounds and its spread."""

    median: float
    low: float
    high: float
    rounds: int

    def __str__(self) -> str:
        return f"{self.median:.2f}× ({self.low:.2f}–{self.high:.2f} over {self.rounds} rounds)"


def ratio(numerators: Sequence[float], denominators: Sequence[float]) -> Ratio:
    """The median and the range of ``numerators[r] / denominators[r]`` over rounds ``r``."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError("ratio needs one numerator and one denominator per round, and at least one round")
    values = [top / bottom for top, bottom in zip(numerators, denominators, strict=True)]
    return Ratio(statistics.median(values), min(values), max(values), len(values))
