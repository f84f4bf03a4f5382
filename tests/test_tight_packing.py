"""The tight packing policy keeps every guarantee of the bagel one (hypothesis), fills toward the cap, stays
near the stream's order and blend; its cost cap equals a plain reference at any chunk size; the cost model
matches a direct computation."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.streams import mix, problems, streamed, whole_array

from mmidx.config import DataConfig
from mmidx.index.cost import LLMGeometry, pack_costs
from mmidx.index.packer import _packer, pack_samples

# A geometry whose attention term dominates at a few dozen tokens (19·n + 2·n²), so the cost cap binds in
# small random problems; Qwen2-7B's (32,512·n + n²) binds only on long samples.
TINY = LLMGeometry(hidden_size=4, num_layers=1, ffn_size=1, num_heads=1, num_kv_heads=1)

# Cost slacks to draw: off, 0 (binds on small problems even with Qwen2-7B's weights), the default.
SLACKS = [None, 0.0, 0.065]


def tight(problem, window, cost_slack=None):
    *rest, budgets = problem
    return (*rest, {**budgets, "policy": "tight", "window": window, "cost_slack": cost_slack})


def tight_one_at_a_time(counts, window, slack, cap=60):
    """(packs, the stream position whose arrival closed each pack (len(counts): the end)) of the tight
    packer fed one item at a time, without mandatory groups or exclusions."""
    packer = _packer(np.zeros(1, bool), cap, cap, cap, 0, 0, len(counts), tight=True, window=window,
                     cost_slack=slack, geometry=TINY)
    counts = np.asarray(counts, dtype=np.int64)
    groups, keys = np.zeros(len(counts), np.int32), np.arange(len(counts), dtype=np.int64)
    packs, closed_at = [], []

    def drain(position):
        items, ends, _, _ = packer.drain()
        packs.extend(np.split(items, ends[:-1]) if len(ends) else [])
        closed_at.extend([position] * len(ends))

    for i in range(len(counts)):
        packer.feed(counts[i:i + 1], groups[i:i + 1], keys[i:i + 1], i, 0)
        drain(i)
        assert i + 1 - sum(map(len, packs)) < window  # the window holds `window` items only while a pack is made
    packer.finish()
    drain(len(counts))
    return packs, closed_at


def assert_window_rules(counts, window, slack):
    """The window's rules, checked on when each pack closed: it never holds more than ``window`` items, its
    earliest item goes into every pack, so an item is packed by the ``window``-th pack closed from its arrival
    and moves ahead of its stream position by at most ``window`` - 2 places. Returns the most it moved ahead."""
    packs, closed_at = tight_one_at_a_time(counts, window, slack)
    placed = np.concatenate(packs) if packs else np.zeros(0, np.int64)
    np.testing.assert_array_equal(np.sort(placed), np.arange(len(counts)))
    unplaced = 0  # the earliest item not in an earlier pack
    done = np.zeros(len(counts), bool)
    for k, items in enumerate(packs):
        assert unplaced in items, (k, items, unplaced)
        done[items] = True
        while unplaced < len(counts) and done[unplaced]:
            unplaced += 1
        for item in items:  # packs closed from the item's arrival to its own
            assert sum(item <= at for at in closed_at[:k + 1]) <= window, (item, k)
    rank = np.empty(len(counts), np.int64)
    rank[placed] = np.arange(len(counts))
    ahead = int((np.arange(len(counts)) - rank).max()) if len(counts) else 0
    assert ahead <= max(window - 2, 0)
    return ahead


@pytest.mark.parametrize("window", [2, 3, 5, 16])
@pytest.mark.parametrize("slack", SLACKS)
def test_the_window_bound_is_exact(window, slack):
    # a pack of 30 tokens has room for the last of `window` items, none of the 31-token ones between
    assert assert_window_rules([30] + [31] * (window - 2) + [30], window, slack) == window - 2
    # one more item in the window would take the 30 after them ahead by `window - 1`
    assert assert_window_rules([30] + [31] * (window - 1) + [30], window, slack) <= window - 2


@pytest.mark.parametrize("big, ones", [(40, 300), (60, 100)])
def test_the_windows_earliest_item_goes_in_over_the_cost_cap(big, ones):
    """After ``ones`` one-token items the stream's average sample is small, so a 40-token item (or one of exactly
    max_num_tokens) costs more than the cap, even at a slack of 100%: as the window's earliest item it still opens
    the next pack. The next big item lifts the cap over the big ones' cost, so a packer that broke the rule would
    still end (and fail here, not hang)."""
    counts = [1] * ones + [big] + [1] * 3 + [big] * 10
    assert_window_rules(counts, 2, 1.0)
    packs, _ = tight_one_at_a_time(counts, 2, 1.0)
    assert [ones] in [pack.tolist() for pack in packs]  # alone: over the cap, nothing went in beside it


@settings(max_examples=40, deadline=None)
@given(problems(), st.sampled_from([1, 2, 5, 16, 1000]), st.integers(1, 40), st.sampled_from(SLACKS))
def test_tight_streamed_packs_equal_the_whole_array_packs_at_any_chunk_size(problem, chunk_size, window, slack):
    problem = tight(problem, window, slack)
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
                          max_num_tokens_per_sample=per_sample, policy="tight", window=window,
                          cost_slack=data.draw(st.sampled_from(SLACKS)),
                          geometry=data.draw(st.sampled_from([None, TINY])))
    placed = np.concatenate([packed.pack_items, packed.excluded]).astype(np.int64)
    np.testing.assert_array_equal(np.sort(placed), np.arange(n))  # exactly once, or excluded
    np.testing.assert_array_equal(np.sort(packed.excluded), np.flatnonzero(counts > per_sample))
    for k in range(len(packed)):
        items = packed.pack(k)
        assert counts[items].sum() == packed.pack_tokens[k] <= cap
        assert len(items) > 0
    assert_mandatory_first(packed, counts, groups, mandatory, per_sample, cap)


def assert_mandatory_first(packed, counts, groups, mandatory, per_sample, cap):
    """A pack's leading items are one of each mandatory group, in group order, while the group still has
    unplaced items when the pack opens and its earliest one fits (as with bagel)."""
    unplaced = {g: list(np.flatnonzero((groups == g) & (counts <= per_sample))) for g in np.flatnonzero(mandatory)}
    for k in range(len(packed)):
        items, leading, tokens = packed.pack(k), [], 0
        for queue in unplaced.values():
            if queue and tokens + counts[queue[0]] <= cap:
                leading.append(queue[0])
                tokens += counts[queue[0]]
        assert list(items[:len(leading)]) == leading, (k, items, leading)
        placed = set(items)
        for g, queue in unplaced.items():
            unplaced[g] = [i for i in queue if i not in placed]


@pytest.mark.parametrize("policy", ["bagel", "tight"])
@pytest.mark.parametrize("slack", SLACKS)
def test_a_mandatory_item_ahead_of_the_stream_that_fills_the_pack_exactly_leads_the_first_pack(policy, slack):
    counts = np.array([10, 20, 30, 10, 20, 60, 10, 60, 20, 10], np.int64)
    groups = np.array([0, 0, 0, 0, 0, 1, 0, 1, 0, 0], np.int32)  # group 1's items lie ahead of the stream
    packed = pack_samples(counts, groups, mandatory=[False, True], max_num_tokens=60, expected_num_tokens=50,
                          max_num_tokens_per_sample=60, prefer_buffer_before=30, max_buffer_size=4, policy=policy,
                          window=3, cost_slack=slack, geometry=TINY)
    assert packed.pack(0).tolist() == [5] and packed.pack(1).tolist() == [7]
    assert_mandatory_first(packed, counts, groups, [False, True], 60, 60)


@pytest.mark.parametrize("policy", ["bagel", "tight"])
@pytest.mark.parametrize("slack", SLACKS)
def test_a_mandatory_item_in_the_window_that_fills_the_pack_exactly_leads_the_first_pack(policy, slack):
    counts = np.array([10, 60, 20, 30, 10, 20, 10, 20], np.int64)
    groups = np.array([0, 1, 0, 0, 0, 0, 0, 0], np.int32)  # group 1's item is in the window, behind item 0
    packed = pack_samples(counts, groups, mandatory=[False, True], max_num_tokens=60, expected_num_tokens=50,
                          max_num_tokens_per_sample=60, prefer_buffer_before=30, max_buffer_size=4, policy=policy,
                          window=3, cost_slack=slack, geometry=TINY)
    assert packed.pack(0).tolist() == [1]
    assert_mandatory_first(packed, counts, groups, [False, True], 60, 60)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=300), st.integers(1, 64), st.sampled_from(SLACKS))
def test_the_windows_earliest_item_is_in_every_pack_and_no_item_moves_ahead_more_than_window_minus_2(counts,
                                                                                                     window, slack):
    assert_window_rules(counts, window, slack)


def test_an_item_can_wait_more_than_window_places_behind_the_small_items_best_fit_takes():
    # big items (over half the cap) go one a pack, as the window's earliest; the 1s fill each of those packs
    counts = [45] * 4 + [1] * 40
    packs, _ = tight_one_at_a_time(counts, 5, None)
    rank = {int(item): r for r, item in enumerate(np.concatenate(packs))}
    assert rank[3] - 3 > 5  # the docs say so: the bound is on packs, and on the places an item moves ahead
    assert_window_rules(counts, 5, None)


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


@pytest.mark.parametrize("tight", [False, True])
def test_a_phase_ends_after_the_packing_that_reaches_its_tokens_exactly(tight):
    """Every pack holds 10 tokens, so a phase of 20 tokens ends where one of 2 packs does, and one of 21 tokens
    where one of 3 packs does (the feed stops before the first item after the packing that reached the limit)."""
    counts = np.full(12, 10, np.int64)

    def stop(**limit):
        packer = _packer(np.array([False]), 10, 10, 10, 0, 0, len(counts), tight=tight, window=2)
        return packer.feed(counts, np.zeros(12, np.int32), np.arange(12, dtype=np.int64), 0, 0, **limit)

    assert stop(stop_packs=2) != stop(stop_packs=3)
    assert stop(stop_tokens=20) == stop(stop_tokens=11) == stop(stop_packs=2)
    assert stop(stop_tokens=21) == stop(stop_packs=3)


def test_bad_budgets_a_cost_cap_too_large_and_a_bad_geometry_are_one_line_saying_what_to_do():
    one = (np.ones(3, np.int64), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="max_num_tokens must be positive, got 0"):
        pack_samples(*one, mandatory=[False], max_num_tokens=0)
    with pytest.raises(ValueError, match="the cost cap handles max_num_tokens up to 16,777,216, got 16,777,217; set "
                                         "cost_slack to None"):
        pack_samples(*one, mandatory=[False], max_num_tokens=(1 << 24) + 1, expected_num_tokens=1,
                     max_num_tokens_per_sample=1, policy="tight", cost_slack=0.0)
    with pytest.raises(ValueError, match="every size of the geometry must be positive, got LLMGeometry"):
        LLMGeometry(hidden_size=0)


@pytest.mark.parametrize("policy", ["bagel", "tight"])
@pytest.mark.parametrize("mandatory", [False, True])
def test_a_negative_token_count_is_refused_naming_its_position(policy, mandatory):
    with pytest.raises(ValueError, match=r"^token_counts\[2\] = -1 is negative$"):
        pack_samples(np.array([5, 3, -1, 4], np.int64), np.zeros(4, np.int32), mandatory=[mandatory], policy=policy)


def test_pack_costs_are_linear_work_plus_attention_squared():
    g = LLMGeometry()  # Qwen2-7B: h 3584, 28 layers, FFN 18944, 28 heads, 4 KV heads
    linear = 2 * 28 * (2 * 3584 ** 2 + 2 * 3584 * 512 + 3 * 3584 * 18944)
    attention = 4 * 28 * 3584
    costs = pack_costs([0, 2, 2, 3], [100, 300, 50], g)
    expected = [linear * 400 + attention * (100 ** 2 + 300 ** 2), 0.0, linear * 50 + attention * 50 ** 2]
    np.testing.assert_allclose(costs, expected)
    with pytest.raises(ValueError, match="pack_offsets"):
        pack_costs([0, 5], [1, 2])



def reference_cost_capped(counts, window, cap, slack, geometry, leak=4096):
    """The tight policy with its cost cap written out plainly (no mandatory groups, nothing excluded): the
    window a list in stream order, each choice a scan; the cap's sums each keep all but 1/``leak`` of
    themselves per item. Returns (packs, cost-capped packs)."""
    linear, attention = geometry.cost_weights
    points = round(slack * 10000)

    def cost(n):
        return linear * n + attention * n * n

    window_items, packs, capped = [], [], 0
    sum_n = sum_n2 = 0  # leaky sums over the items that entered the window: each keeps all but 1/leak

    def close_one():
        nonlocal capped
        limit = None
        if sum_n > 0:
            full = linear * cap + int(float(attention * cap) * (float(sum_n2) / float(sum_n)))  # C's doubles
            limit = full + full // 10000 * points + full % 10000 * points // 10000
        pack, tokens, spent = [], 0, 0

        def fits(p, exempt=False):
            return tokens + counts[p] <= cap and (exempt or limit is None or spent + cost(counts[p]) <= limit)

        while window_items and tokens < cap // 2 and fits(window_items[0], exempt=not pack):  # seeds
            p = window_items.pop(0)
            pack.append(p)
            tokens, spent = tokens + counts[p], spent + cost(counts[p])
        while tokens < cap:  # best fit: the largest count that fits both, the earliest among equals
            fitting = [p for p in window_items if fits(p)]
            if not fitting:
                break
            p = max(fitting, key=lambda q: (counts[q], -q))
            window_items.remove(p)
            pack.append(p)
            tokens, spent = tokens + counts[p], spent + cost(counts[p])
        capped += tokens < cap and any(tokens + counts[p] <= cap for p in window_items)
        packs.append(pack)

    for position, n in enumerate(counts):
        sum_n += n - sum_n // leak
        sum_n2 += n * n - sum_n2 // leak
        window_items.append(position)
        while len(window_items) >= window:
            close_one()
    while window_items:
        close_one()
    return packs, capped


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=300), st.integers(1, 40), st.integers(40, 80),
       st.sampled_from([0.0, 0.01, 0.065, 0.3]), st.sampled_from([TINY, LLMGeometry()]), st.integers(1, 50),
       st.sampled_from([1, 1 << 15]))  # 1 << 15: neighbouring counts share a bin of the window
def test_the_cost_cap_equals_a_plain_reference_at_any_chunk_size(counts, window, cap, slack, geometry, chunk, scale):
    counts, cap = [c * scale + c % 3 for c in counts], cap * scale + 2  # every count fits: none excluded
    reference, capped = reference_cost_capped(counts, window, cap, slack, geometry)
    counts = np.array(counts, dtype=np.int64)
    groups = np.zeros(len(counts), np.int32)
    packed = pack_samples(counts, groups, mandatory=[False], max_num_tokens=cap, expected_num_tokens=cap,
                          max_num_tokens_per_sample=cap, policy="tight", window=window, cost_slack=slack,
                          geometry=geometry)
    assert [packed.pack(k).tolist() for k in range(len(packed))] == reference
    assert packed.stats["cost_capped_packs"] == capped
    # the kernel fed a chunk at a time carries the cap's leaky sums across chunks: the same packs
    packer = _packer(np.array([False]), cap, cap, cap, 0, 0, len(counts), tight=True, window=window,
                     cost_slack=slack, geometry=geometry)
    positions = np.arange(len(counts), dtype=np.int64)
    for start in range(0, len(counts), chunk):
        end = min(start + chunk, len(counts))
        assert packer.feed(counts[start:end], groups[start:end], positions[start:end], start, 0) == (end - start, -1)
    packer.finish()
    items, ends, _, _ = packer.drain()
    assert [items[a:b].tolist() for a, b in zip(np.r_[0, ends][:-1], ends, strict=True)] == reference


def test_the_cost_caps_sums_forget_1_in_4096_of_themselves_per_item():
    """After 1,000 samples of 4 tokens the cap is that of short samples; as 30-token ones come in, it rises at the
    pace of its leaky sums, which decides how many long samples each pack takes. A sum under 4,096 leaks nothing,
    so the short streams of the property test above cannot tell the leak's rate; this one can (a leak twice or
    half as fast gives other packs)."""
    counts = [4] * 1000 + [30, 4] * 60
    expected, capped = reference_cost_capped(counts, 10, 80, 0.0, TINY)
    assert capped > 0
    assert all(reference_cost_capped(counts, 10, 80, 0.0, TINY, leak)[0] != expected for leak in (2048, 8192))
    packed = pack_samples(np.array(counts, np.int64), np.zeros(len(counts), np.int32), mandatory=[False],
                          max_num_tokens=80, expected_num_tokens=80, max_num_tokens_per_sample=80, policy="tight",
                          window=10, cost_slack=0.0, geometry=TINY)
    assert [packed.pack(k).tolist() for k in range(len(packed))] == expected
    assert packed.stats["cost_capped_packs"] == capped


def test_the_cost_caps_slack_is_added_in_full_to_a_cap_under_10000_units():
    """The cap, (1 + slack) × the cost of a full pack, is computed in integers as full // 10000 × the slack's
    points plus the remainder's share of them: on small costs (full under 10,000 units) that share is all of it."""
    # TINY costs 19n + 2n²; the four items' Σn²/Σn is 2050/84, so full = 19·80 + ⌊160·2050/84⌋ = 5,424 and the
    # cap with 30% slack 5,424 + ⌊5,424·3000/10000⌋ = 7,051. Items 0 and 1 are seeded (48 tokens, cost 3,232);
    # item 3 (29 tokens, cost 2,233) fits that cap (5,465) but not 5,424, where best fit would take item 2 (7).
    packed = pack_samples(np.array([26, 22, 7, 29], np.int64), np.zeros(4, np.int32), mandatory=[False],
                          max_num_tokens=80, expected_num_tokens=80, max_num_tokens_per_sample=80, policy="tight",
                          window=6, cost_slack=0.3, geometry=TINY)
    assert [packed.pack(k).tolist() for k in range(len(packed))] == [[0, 1, 3], [2]]


def test_the_cost_cap_binds_on_long_samples_and_none_turns_it_off():
    counts, groups = mix("scale", 20_000)
    capped, plain = (pack_samples(counts, groups, mandatory=[False] * 3, policy="tight", cost_slack=s)
                     for s in (0.065, None))
    costs = [pack_costs(p.pack_offsets, counts[p.pack_items]) for p in (capped, plain)]
    assert capped.stats["cost_capped_packs"] > 0 and "cost_capped_packs" not in plain.stats
    # the dearest packs cost less, at a small loss of fill
    assert np.quantile(costs[0], 0.99) < np.quantile(costs[1], 0.99)
    assert 0.995 <= capped.pack_tokens[:-1].mean() / 36864 < plain.pack_tokens[:-1].mean() / 36864


def test_cost_slack_in_the_data_yaml_is_checked_and_null_turns_the_cap_off(tmp_path):
    path = tmp_path / "data.yaml"
    path.write_text("groups: {g: {datasets: [x]}}\npacking: {policy: tight, cost_slack: null}")
    assert DataConfig.from_yaml(path).packing.cost_slack is None
    path.write_text("groups: {g: {datasets: [x]}}\npacking: {policy: tight}")
    assert DataConfig.from_yaml(path).packing.cost_slack == 0.065
    for value, message in (("lots", "packing.cost_slack must be a number"), ("2", "fraction in \\[0, 1\\]")):
        path.write_text(f"groups: {{g: {{datasets: [x]}}}}\npacking: {{policy: tight, cost_slack: {value}}}")
        with pytest.raises(ValueError, match=message):
            DataConfig.from_yaml(path)
    with pytest.raises(ValueError, match="cost_slack"):
        pack_samples(np.ones(3, np.int64), np.zeros(3, np.int32), mandatory=[False], policy="tight", cost_slack=-1)
