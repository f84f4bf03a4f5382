"""Random grouping of consecutive frames: BAGEL's ``split_integer_exp_decay`` (``data/data_utils.py``).

BAGEL's paper: "to enhance generation consistency, we randomly group consecutive images and apply
full attention within each group; the noise level is the same inside each group". BAGEL defines
the draw but ships no dataset that calls it; :mod:`mmidx.sources.video_gen` does.

The definition, for S >= 1 frames and a decay d in [0, 1]:

1. the number of groups N is drawn from 1..S: uniformly when d = 1.0 (``randint(1, S)``), else
   with P(N = k) = d^(k-1) · (1 - d) / (1 - d^S) (``choices(range(1, S + 1), p)``), an
   exponential preference for fewer groups; d = 0 always gives one group;
2. the N - 1 cut points are a uniform random subset of 1..S-1 (``sorted(sample(range(1, S), N - 1))``),
   so given N every composition of S into N positive parts is equally likely;
3. the groups are the runs between consecutive cuts, in order.

The draw is a pure function of the generator: it makes exactly BAGEL's calls, in BAGEL's order, on
``rng`` instead of the ``random`` module, so a ``random.Random`` in the state of BAGEL's global
``random`` gives BAGEL's groups.
"""

from __future__ import annotations

import math
import random


def split_integer_exp_decay(rng: random.Random, total: int, decay: float = 1.0) -> tuple[list[int], list[int]]:
    """Cut ``total`` consecutive frames into groups; returns (group sizes, bounds ``[0, ..., total]``).

    ``decay`` is BAGEL's ``ng_sample_decay`` (module docstring: 1.0 draws the group count uniformly,
    below 1.0 prefers fewer groups). Group k covers frames ``bounds[k]:bounds[k + 1]``.
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"need a positive number of frames to group, not {total!r}")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must lie in [0, 1], not {decay}")
    if decay == 1.0:
        count = rng.randint(1, total)
    else:
        base = (1 - decay) / (1 - math.pow(decay, total))
        weights = [base * math.pow(decay, k) for k in range(total)]
        count = rng.choices(range(1, total + 1), weights, k=1)[0]
    bounds = [0, *sorted(rng.sample(range(1, total), count - 1)), total]
    return [bounds[k + 1] - bounds[k] for k in range(count)], bounds
