"""The tight packing policy keeps every guarantee of the bagel one (hypothesis), fills toward the cap, stays
near the stream's order and blend; the cost model matches a direct computation."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.streams import mix, problems, streamed, whole_array

from mmidx.index.cost import LLMGeometry, pack_costs
from mmidx.index.packer import pack_samples


def tight(problem, window):
    *rest, budgets = problem
    return (*rest, {**budgets, "policy": "tight", "window": window})


@settings(max_examples=40, deadline=None)
@given(problems(), st.sampled_from([1, 2, 5, 16, 1000]), st.integers(1, 40))
def test_tight_streamed_packs_equal_the_whole_array_packs_at_any_chunk_size(problem, chunk_size, window):
    problem = tight(problem, window)
    reference = whole_array(*problem)
    ours = streamed(*problem, chunk_size)
    for a, b in zip(ours[:3], reference[:3], strict=True):
        np.testing.assert_array_equal(a, b)
    assert ours[3] == reference[3]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_tight_places_every_item_once_under_the_cap_mandatory_first(data):
    n = data.draw(st.integers(0, 400))
    num_groups = data.draw(st.integers(1, 3))
    cap = data.draw(st.integers(10, 80))
    per_sample = data.draw(st.integers(1, cap))
    counts = np.array(data.draw(st.lists(st.integers(0, cap + 5), min_size=n, max_size=n)), dtype=np.int64)
    groups = np.array(data.draw(st.lists(st.integers(0, num_groups - 1), min_size=n, max_size=n)), dtype=np.int32)
    mandatory = data.draw(st.lists(st.booleans(), min_size=num_groups, max_size=num_groups))
    window = data.draw(st.integers(1, 64))
    packed = pack_samples(counts, groups, mandatory=mandatory, max_num_tokens=cap, expected_num_tokens=cap,
                          max_num_tokens_per_sample=per_sample, policy="tight", window=window)
    placed = np.concatenate([packed.pack_items, packed.excluded]).astype(np.int64)
    np.testing.assert_array_equal(np.sort(placed), np.arange(n))  # exactly once, or excluded
    np.testing.assert_array_equal(np.sort(packed.excluded), np.flatnonzero(counts > per_sample))
    for k in range(len(packed)):
        items = packed.pack(k)
        assert counts[items].sum() == packed.pack_tokens[k] <= cap
        assert len(items) > 0
    # mandatory: a pack's leading items are one of each mandatory group, in group order, while the
    # group still has unplaced items when the pack opens and its earliest one fits (as with bagel)
    first_of = {g: np.flatnonzero(groups[packed.pack_items] == g) for g in range(num_groups)}
    for g in np.flatnonzero(mandatory):
        items_of_g = np.sort(np.flatnonzero((groups == g) & (counts <= per_sample)))
        np.testing.assert_array_equal(np.sort(packed.pack_items[first_of[g]]), items_of_g)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=600), st.integers(1, 64))
def test_an_item_is_placed_within_the_window_of_its_stream_position(counts, window):
    counts = np.array(counts, dtype=np.int64)
    packed = pack_samples(counts, np.zeros(len(counts), np.int32), mandatory=[False], max_num_tokens=60,
                          expected_num_tokens=60, max_num_tokens_per_sample=60, policy="tight", window=window)
    rank = np.empty(len(counts), np.int64)
    rank[packed.pack_items] = np.arange(len(counts))
    assert np.all(np.abs(rank - np.arange(len(counts))) < window)


@pytest.mark.parametrize("kind", ["scale", "text", "video"])
def test_tight_fills_the_cap_and_keeps_group_shares_over_any_100_packs(kind):
    counts, groups = mix(kind, 40_000)
    packed = pack_samples(counts, groups, mandatory=[False] * (groups.max() + 1), policy="tight")
    assert packed.pack_tokens[:-1].mean() / 36864 >= 0.995
    share = np.bincount(groups) / len(groups)
    in_order = groups[packed.pack_items]
    ends = packed.pack_offsets
    for k in range(len(packed) - 100):
        window = in_order[ends[k]:ends[k + 100]]
        assert np.abs(np.bincount(window, minlength=len(share)) / len(window) - share).max() <= 0.02, k


def test_bagel_fills_less_than_tight_on_the_scale_mix():
    counts, groups = mix("scale", 20_000)
    fills = [pack_samples(counts, groups, mandatory=[False] * 3, policy=p).pack_tokens[:-1].mean() / 36864
             for p in ("bagel", "tight")]
    assert fills[0] < 0.95 < 0.995 <= fills[1]


def test_unknown_policy_and_bad_window_are_one_clear_error():
    with pytest.raises(ValueError, match="policy"):
        pack_samples(np.ones(3, np.int64), np.zeros(3, np.int32), mandatory=[False], policy="greedy")
    with pytest.raises(ValueError, match="window"):
        pack_samples(np.ones(3, np.int64), np.zeros(3, np.int32), mandatory=[False], policy="tight", window=0)


def test_pack_costs_are_linear_work_plus_attention_squared():
    g = LLMGeometry()  # Qwen2-7B: h 3584, 28 layers, FFN 18944, 28 heads, 4 KV heads
    linear = 2 * 28 * (2 * 3584 ** 2 + 2 * 3584 * 512 + 3 * 3584 * 18944)
    attention = 4 * 28 * 3584
    costs = pack_costs([0, 2, 2, 3], [100, 300, 50], g)
    expected = [linear * 400 + attention * (100 ** 2 + 300 ** 2), 0.0, linear * 50 + attention * 50 ** 2]
    np.testing.assert_allclose(costs, expected)
    with pytest.raises(ValueError, match="pack_offsets"):
        pack_costs([0, 5], [1, 2])
