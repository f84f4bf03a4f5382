"""BAGEL's video-generation helpers written from their definitions, for tests only (never mmidx's code).

``add_video`` is ``InterleavedBaseIterableDataset._add_video``'s sequence plan (BAGEL's
``data/interleave_datasets/interleave_t2i_dataset.py``); ``split_integer_exp_decay`` is BAGEL's
``data/data_utils.py`` function on the global ``random`` module; ``composition_probability`` is
the probability its definition gives to one grouping.
"""

from __future__ import annotations

import math
import random


def add_video(frame_indexes: list[int], need_loss: bool, need_vae: bool, enable_cfg: bool = True) -> list[dict]:
    """The plan ``_add_video(data, frames, frame_indexes, need_loss, need_vae, enable_cfg)`` appends."""
    assert int(need_loss) + int(need_vae) == 1
    plan = []
    for idx, frame_idx in enumerate(frame_indexes):
        item = {"type": "vae_image", "enable_cfg": 0 if need_loss else int(enable_cfg), "loss": int(need_loss),
                "special_token_loss": 0, "special_token_label": None,
                "split_start": idx == 0, "split_end": idx == len(frame_indexes) - 1}
        if idx < len(frame_indexes) - 1:
            item["frame_delta"] = frame_indexes[idx + 1] - frame_idx
        plan.append(item)
    return plan


def split_integer_exp_decay(S: int, ng_sample_decay: float = 1.0) -> tuple[list[int], list[int]]:
    """BAGEL's draw, on the global ``random`` module."""
    if ng_sample_decay == 1.0:
        N = random.randint(1, S)
    else:
        base = (1 - ng_sample_decay) / (1 - math.pow(ng_sample_decay, S))
        p = [base * math.pow(ng_sample_decay, i) for i in range(S)]
        N = random.choices(list(range(1, S + 1)), p, k=1)[0]
    cumsum = [0, *sorted(random.sample(range(1, S), N - 1)), S]
    result = [cumsum[i + 1] - cumsum[i] for i in range(len(cumsum) - 1)]
    return result, cumsum


def composition_probability(sizes: tuple[int, ...], decay: float) -> float:
    """P(the draw gives ``sizes``): P(N = len(sizes)) times 1 / C(S - 1, N - 1) (cuts a uniform subset)."""
    S, N = sum(sizes), len(sizes)
    p_count = 1 / S if decay == 1.0 else decay ** (N - 1) * (1 - decay) / (1 - decay**S)
    return p_count / math.comb(S - 1, N - 1)
