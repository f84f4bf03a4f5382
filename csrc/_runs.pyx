# cython: boundscheck=False, wraparound=False, language_level=3
"""Integer runs made into one int64 array in one pass (:class:`mmidx.pack.runs.Runs`): run ``i`` is
``starts[i] + steps[i] * k`` for ``k < lengths[i]``, the runs in order.

A pack's index and position-id keys are a few hundred to a few thousand such runs; numpy makes them in six
whole-array passes (arange, three repeats, a multiply and an add), this in one over the output.
"""

import numpy as np


def int_runs(list starts, list lengths, list steps):
    """The concatenated runs as a new int64 array; ValueError for lists of different lengths or a negative
    length."""
    cdef Py_ssize_t count = len(lengths), i, k, filled = 0, total = 0
    cdef long long start, step, length
    if len(starts) != count or len(steps) != count:
        raise ValueError(f"runs need one start, length and step each: got {len(starts)}, {count}, {len(steps)}")
    for i in range(count):
        length = lengths[i]
        if length < 0:
            raise ValueError(f"run {i} has a negative length ({length})")
        total += length
    out = np.empty(total, np.int64)
    cdef long long[::1] values = out
    for i in range(count):
        start, step, length = starts[i], steps[i], lengths[i]
        for k in range(length):
            values[filled + k] = start + step * k
        filled += length
    return out
