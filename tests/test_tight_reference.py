"""The tight policy's packs equal a naive reference of its rules, written out over Python lists."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mmidx.index.packer import pack_samples


def reference_tight(counts, groups, mandatory, max_num_tokens, max_num_tokens_per_sample, window):
    """(packs, excluded) by the rules of ``pack_samples(policy="tight", cost_slack=None)``, item by item."""
    counts, groups = [int(c) for c in counts], [int(g) for g in groups]
    excluded = [i for i, c in enumerate(counts) if c > max_num_tokens_per_sample]
    done = set(excluded)  # placed or excluded
    held, packs = [], []  # the window, in stream order

    def make_pack():
        pack = []

        def take(i):
            if i in held:
                held.remove(i)
            pack.append(i)
            done.add(i)

        def total():
            return sum(counts[i] for i in pack)

        for g in (g for g, m in enumerate(mandatory) if m):  # the group's earliest item not placed yet
            first = next((i for i in range(len(counts)) if groups[i] == g and i not in done), None)
            if first is not None and total() + counts[first] <= max_num_tokens:
                take(first)
        while held and total() < max_num_tokens // 2 and total() + counts[held[0]] <= max_num_tokens:
            take(held[0])  # seeds in stream order, up to half the cap
        while total() < max_num_tokens and (fitting := [i for i in held if counts[i] <= max_num_tokens - total()]):
            take(min(fitting, key=lambda i: (-counts[i], i)))  # best fit: largest, earliest among equals, until full
        if pack:
            packs.append(pack)

    for i in range(len(counts)):
        if i not in done:
            held.append(i)
            while len(held) >= window:
                make_pack()
    while held:
        make_pack()
    return packs, excluded


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_tight_packs_equal_a_naive_reference_of_the_rules(data):
    scale = data.draw(st.sampled_from([1, 1 << 15, 1 << 32]))  # 1 << 15: neighbouring counts share a bin
    cap = data.draw(st.integers(4, 60))
    num_groups = data.draw(st.integers(1, 3))
    mandatory = data.draw(st.lists(st.booleans(), min_size=num_groups, max_size=num_groups))
    n = data.draw(st.integers(0, 120))
    groups = np.array(data.draw(st.lists(st.integers(0, num_groups - 1), min_size=n, max_size=n)), np.int32)
    counts = np.array(data.draw(st.lists(st.integers(0, cap + 5), min_size=n, max_size=n)), np.int64) * scale
    counts += np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), np.int64)
    per_sample = data.draw(st.integers(1, cap)) * scale
    window = data.draw(st.integers(1, 20))
    result = pack_samples(counts, groups, mandatory=mandatory, max_num_tokens=cap * scale,
                          expected_num_tokens=cap * scale, max_num_tokens_per_sample=per_sample, policy="tight",
                          window=window, cost_slack=None)  # tokens only (test_tight_packing.py: the cost cap)
    expected, excluded = reference_tight(counts, groups, mandatory, cap * scale, per_sample, window)
    assert [result.pack(k).tolist() for k in range(len(result))] == expected
    assert result.excluded.tolist() == excluded
