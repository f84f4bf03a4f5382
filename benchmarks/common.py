"""What every benchmark script shares: a one-line description of the machine, and best-of-N timing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


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
