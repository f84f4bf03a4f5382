"""Batch keys recorded as runs (:class:`mmidx.pack.runs.Runs`) equal the per-element arrays they replace:
``np.arange(start, start + length)`` for step 1 and ``np.full(length, start)`` for step 0, concatenated and cast."""

import numpy as np
import pytest
import torch

from mmidx.pack.runs import Runs


def _reference(runs, dtype):
    arrays = [np.arange(start, start + length) if step else np.full(length, start)
              for start, length, step in runs]
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)


def test_runs_equal_the_concatenated_per_element_arrays():
    rng = np.random.default_rng(0)
    for trial in range(300):
        count = int(rng.integers(0, 12))
        floats = trial % 3 == 0
        runs = []
        for _ in range(count):
            length = int(rng.integers(0, 50))
            if floats:  # weights and timesteps: repeated values, -inf among them
                runs.append((float(rng.choice([-np.inf, 1.0, rng.normal(), 1 / (length + 1) ** 0.5])), length, 0))
            else:
                runs.append((int(rng.integers(-5, 40000)), length, int(rng.integers(0, 2))))
        recorded = Runs()
        for run in runs:
            recorded.add(*run)
        assert len(recorded) == count and bool(recorded) == bool(count)
        for dtype in ((np.float32,) if floats else (np.int64, np.float32)):
            got = recorded.tensor(dtype)
            expected = torch.from_numpy(_reference(runs, dtype))
            assert got.dtype == expected.dtype and torch.equal(got, expected), (trial, runs)


def test_the_run_kernel_refuses_a_negative_length_and_lists_of_different_lengths():
    from mmidx import _runs

    assert _runs.int_runs([3, 10], [2, 3], [1, 0]).tolist() == [3, 4, 10, 10, 10]
    with pytest.raises(ValueError, match="negative length"):
        _runs.int_runs([0, 5], [4, -1], [1, 1])
    with pytest.raises(ValueError, match="one start, length and step each"):
        _runs.int_runs([0], [1, 2], [1, 1])
