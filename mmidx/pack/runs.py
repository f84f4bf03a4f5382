"""Batch keys made of runs (index ranges, repeated rope ids, weights, timesteps), recorded per element as three
numbers and made into one array per pack in one pass (:mod:`mmidx._runs`), instead of one small numpy array per
element.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmidx import _runs


class Runs:
    """The runs one batch key accumulates, element after element: run i is ``start_i + step_i * k`` for
    ``k < length_i`` (``np.arange(start, start + length)`` with step 1, ``np.full(length, start)`` with step 0).

    A float key (weights, timesteps) has step 0 only: its values are repeated, never computed, so -inf stays
    -inf and every value is bit-identical to the per-element arrays'."""

    __slots__ = ("lengths", "starts", "steps")

    def __init__(self) -> None:
        self.starts: list[int | float] = []
        self.lengths: list[int] = []
        self.steps: list[int] = []

    def add(self, start: int | float, length: int, step: int = 1) -> None:
        """Append the run of ``length`` values from ``start`` by ``step`` (0 or 1)."""
        self.starts.append(start)
        self.lengths.append(length)
        self.steps.append(step)

    def __len__(self) -> int:
        """The number of runs (a key without runs is left out of the batch)."""
        return len(self.lengths)

    def tensor(self, dtype: Any) -> torch.Tensor:
        """All runs, in order, as one tensor of numpy dtype ``dtype``."""
        if not any(self.steps):  # repeated values only (and every float key)
            values = np.repeat(np.array(self.starts), np.array(self.lengths, np.int64))
        else:
            values = _runs.int_runs(self.starts, self.lengths, self.steps)
        return torch.from_numpy(values.astype(dtype, copy=False))
