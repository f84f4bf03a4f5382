"""What every benchmark script shares: a one-line description of the machine, and best-of-N timing."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any


def machine(*packages: str) -> str:
    """CPU model and cores, Python, and the versions of the named installed distributions."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = []
    for name in packages:
        try:
            versions.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    return ", ".join([f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}", *versions])


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
