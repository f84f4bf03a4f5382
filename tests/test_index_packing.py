"""Multimodal packing: the guarantees under hypothesis, and each rule on a stream worked by hand."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmidx.index.packer import PackingResult, pack_samples

SETTINGS = settings(max_examples=100, deadline=None)


@st.composite
def packing_problems(draw, mandatory_fit_together=False):
    """A stream and budgets; ``scale`` 2**32 moves every count and budget into int64 territory."""
    scale = draw(st.sampled_from([1, 2**32]))
    max_num_tokens = draw(st.integers(4, 60))
    num_groups = draw(st.integers(1, 4))
    mandatory = draw(st.lists(st.booleans(), min_size=num_groups, max_size=num_groups))
    n = draw(st.integers(0, 120))
    groups = draw(st.lists(st.integers(0, num_groups - 1), min_size=n, max_size=n))
    # Mandatory items small enough that one of each group always fits in a pack together.
    mandatory_cap = max_num_tokens // max(sum(mandatory), 1)
    counts = [
        draw(st.integers(0, mandatory_cap if mandatory_fit_together and mandatory[g] else max_num_tokens + 5))
        for g in groups
    ]
    budgets = {
        "max_num_tokens": max_num_tokens * scale,
        "expected_num_tokens": draw(st.integers(1, max_num_tokens)) * scale,
        "max_num_tokens_per_sample": draw(st.integers(1, max_num_tokens)) * scale,
        "prefer_buffer_before": draw(st.integers(0, max_num_tokens + 5)) * scale,
        "max_buffer_size": draw(st.integers(0, 6)),
    }
    return np.array(counts, dtype=np.int64) * scale, np.array(groups, dtype=np.int32), mandatory, budgets


def packs(result: PackingResult) -> list[list[int]]:
    return [result.pack(k).tolist() for k in range(len(result))]


@SETTINGS
@given(packing_problems())
def test_every_item_is_in_exactly_one_pack_or_excluded(problem):
    counts, groups, mandatory, budgets = problem
    result = pack_samples(counts, groups, mandatory=mandatory, **budgets)
    placed_or_excluded = np.concatenate((result.pack_items, result.excluded))
    assert sorted(placed_or_excluded.tolist()) == list(range(len(counts)))
    assert result.stats["num_items"] == len(result.pack_items)
    assert all(len(pack) > 0 for pack in packs(result))


@SETTINGS
@given(packing_problems())
def test_no_pack_exceeds_max_num_tokens(problem):
    counts, groups, mandatory, budgets = problem
    result = pack_samples(counts, groups, mandatory=mandatory, **budgets)
    assert result.pack_tokens.dtype == np.int64
    assert [sum(counts[pack].tolist()) for pack in packs(result)] == result.pack_tokens.tolist()
    assert np.all(result.pack_tokens <= budgets["max_num_tokens"])


@SETTINGS
@given(packing_problems())
def test_excluded_are_exactly_the_items_over_the_per_sample_limit(problem):
    counts, groups, mandatory, budgets = problem
    result = pack_samples(counts, groups, mandatory=mandatory, **budgets)
    over = np.flatnonzero(counts > budgets["max_num_tokens_per_sample"])
    np.testing.assert_array_equal(result.excluded, over)
    assert result.stats["excluded"] == len(over)


@SETTINGS
@given(packing_problems())
def test_packs_are_a_pure_function_of_the_inputs(problem):
    counts, groups, mandatory, budgets = problem
    first = pack_samples(counts, groups, mandatory=mandatory, **budgets)
    # Same values in other dtypes and memory layouts.
    strided_counts = np.repeat(counts, 2)[::2]
    again = pack_samples(strided_counts, groups.astype(np.int64), mandatory=np.array(mandatory), **budgets)
    for name in ("pack_offsets", "pack_items", "excluded", "pack_tokens"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert first.stats == again.stats


@SETTINGS
@given(packing_problems(mandatory_fit_together=True))
def test_every_pack_starts_with_the_earliest_remaining_item_of_each_mandatory_group(problem):
    counts, groups, mandatory, budgets = problem
    result = pack_samples(counts, groups, mandatory=mandatory, **budgets)
    pack_of = np.full(len(counts), -1)
    for k, pack in enumerate(packs(result)):
        pack_of[pack] = k
    for k, pack in enumerate(packs(result)):
        if len(pack) == 1:
            continue  # solo packs hold a single buffered item by design
        # Items in pack k or later were all unplaced when pack k started.
        expected_prefix = []
        for group in np.flatnonzero(mandatory):
            remaining = np.flatnonzero((groups == group) & (pack_of >= k))
            if len(remaining):  # otherwise the group is exhausted
                expected_prefix.append(int(remaining[0]))
        assert pack[: len(expected_prefix)] == expected_prefix


def test_items_that_do_not_fit_wait_in_the_buffer_for_the_largest_fitting_first():
    # Pack 0 takes 8 and closes at 10 with the 2; 3, 4, 4, 5 wait. The next pack takes 5, then the
    # earlier of the two 4s; the last one gets the other 4 and the 3.
    counts = [8, 3, 4, 4, 5, 2]
    result = pack_samples(
        counts, [0] * 6, mandatory=[False], max_num_tokens=10, expected_num_tokens=10,
        max_num_tokens_per_sample=10, prefer_buffer_before=10, max_buffer_size=10,
    )  # fmt: skip
    assert packs(result) == [[0, 5], [4, 2], [3, 1]]
    assert result.pack_tokens.tolist() == [10, 9, 7]
    assert result.stats["deferred"] == 4
    assert result.stats["max_deferral"] == 2
    assert result.stats["partial_last_pack"] is True


@pytest.mark.parametrize(
    ("prefer_buffer_before", "expected_packs"), [(4, [[0, 3], [1, 2, 4, 5]]), (3, [[0, 3], [1, 4, 5, 2]])]
)
def test_the_buffer_refills_a_new_pack_only_below_prefer_buffer_before(prefer_buffer_before, expected_packs):
    # The two deferred 3s: both refill the second pack while it holds < 4 tokens; with 3, only one
    # does, the stream's 1s come next, and the other 3 tops the pack up at the end of the stream.
    result = pack_samples(
        [8, 3, 3, 2, 1, 1], [0] * 6, mandatory=[False], max_num_tokens=10, expected_num_tokens=10,
        max_num_tokens_per_sample=10, prefer_buffer_before=prefer_buffer_before, max_buffer_size=10,
    )  # fmt: skip
    assert packs(result) == expected_packs


def test_a_mandatory_item_that_does_not_fit_is_first_in_line_for_the_next_pack():
    # Groups 0 and 1 are mandatory; 6 + 6 > 10, so pack 0 opens with group 0's item alone. Group 1's
    # earliest item (position 1) is deferred, and opens pack 1 right after group 0's next one.
    result = pack_samples(
        [6, 6, 3, 4], [0, 1, 1, 0], mandatory=[True, True], max_num_tokens=10, expected_num_tokens=10,
        max_num_tokens_per_sample=10, prefer_buffer_before=0, max_buffer_size=10,
    )  # fmt: skip
    assert packs(result) == [[0, 2], [3, 1]]


def test_solo_packs_keep_the_buffer_bounded_when_nothing_fits_beside_mandatory_items():
    # Every pack opens with a 9-token mandatory item, so no 5 ever fits beside it: each time the
    # buffer overflows (2 > max_buffer_size 1) its largest item leaves as a pack of its own.
    counts = [9, 5, 5, 5, 9, 9, 9]
    groups = [0, 1, 1, 1, 0, 0, 0]
    result = pack_samples(
        counts, groups, mandatory=[True, False], max_num_tokens=10, expected_num_tokens=10,
        max_num_tokens_per_sample=10, prefer_buffer_before=10, max_buffer_size=1,
    )  # fmt: skip
    assert packs(result) == [[0], [1], [4], [2], [5], [6], [3]]
    assert result.stats["solo_packs"] == 2
    assert result.stats["deferred"] == 4
    assert result.stats["max_deferral"] == 4


def test_stats_report_fill_and_a_partial_last_pack():
    result = pack_samples(
        [6, 4, 6, 4, 3], [0] * 5, mandatory=[False], max_num_tokens=12, expected_num_tokens=10,
        max_num_tokens_per_sample=12, prefer_buffer_before=0, max_buffer_size=4,
    )  # fmt: skip
    assert packs(result) == [[0, 1], [2, 3], [4]]
    assert result.stats["num_packs"] == 3
    assert result.stats["partial_last_pack"] is True
    assert result.stats["fill_vs_max"] == pytest.approx(23 / 3 / 12)
    assert result.stats["fill_vs_expected"] == pytest.approx(23 / 3 / 10)


def test_empty_stream_gives_no_packs():
    result = pack_samples(np.zeros(0, np.int64), np.zeros(0, np.int32), mandatory=[True])
    assert len(result) == 0 and result.pack_offsets.tolist() == [0]
    assert result.stats["partial_last_pack"] is False


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ({"expected_num_tokens": 40_000}, "expected_num_tokens"),
        ({"max_num_tokens_per_sample": 40_000}, "max_num_tokens_per_sample"),
        ({"max_buffer_size": -1}, "non-negative"),
    ],
)
def test_inconsistent_budgets_are_refused(budgets, message):
    with pytest.raises(ValueError, match=message):
        pack_samples([5], [0], mandatory=[False], **budgets)


def test_invalid_items_are_refused_with_their_position():
    with pytest.raises(ValueError, match="group ids must be in"):
        pack_samples([5, 5], [0, 2], mandatory=[False, True])
    with pytest.raises(ValueError, match=r"token_counts\[1\] = -3"):
        pack_samples([5, -3], [0, 0], mandatory=[False])


def reference_packs(counts, groups, mandatory, max_num_tokens, expected_num_tokens, max_num_tokens_per_sample,
                    prefer_buffer_before, max_buffer_size):
    """The rules of pack_samples, written out naively over Python lists: (packs, excluded, stats)."""
    counts, groups = [int(c) for c in counts], [int(g) for g in groups]
    excluded = [i for i, c in enumerate(counts) if c > max_num_tokens_per_sample]
    done = set(excluded)  # placed or excluded
    buffer, deferred_at, packs, pack = [], {}, [], []
    stats = {"deferred": 0, "max_deferral": 0, "solo_packs": 0}

    def total():
        return sum(counts[i] for i in pack)

    def take(i):
        if i in buffer:
            buffer.remove(i)
            stats["max_deferral"] = max(stats["max_deferral"], len(packs) - deferred_at[i])
        pack.append(i)
        done.add(i)

    def largest_fitting(room):
        fitting = [i for i in buffer if counts[i] <= room]
        return min(fitting, key=lambda i: (-counts[i], i)) if fitting else None

    def place_mandatory():
        for g in (g for g, m in enumerate(mandatory) if m):
            first = next((i for i in range(len(counts)) if groups[i] == g and i not in done), None)
            if first is not None and total() + counts[first] <= max_num_tokens:
                take(first)

    def fill(below):
        while total() < below and (i := largest_fitting(max_num_tokens - total())) is not None:
            take(i)

    def close():
        if pack:
            packs.append(pack.copy())
            pack.clear()

    def open_pack():
        while True:
            place_mandatory()
            fill(prefer_buffer_before)
            if len(buffer) > max_buffer_size:  # a solo pack, ahead of the open one
                held = pack.copy()
                pack.clear()
                take(largest_fitting(max_num_tokens))
                close()
                pack.extend(held)
                stats["solo_packs"] += 1
            if total() < expected_num_tokens:
                return
            close()

    open_pack()
    for i in range(len(counts)):
        if i in done:
            continue
        if total() + counts[i] <= max_num_tokens:
            take(i)
        else:
            buffer.append(i)
            deferred_at[i] = len(packs)
            stats["deferred"] += 1
        if total() >= expected_num_tokens or len(buffer) > max_buffer_size:
            close()
            open_pack()
    fill(expected_num_tokens)
    close()
    while buffer:
        place_mandatory()
        fill(expected_num_tokens)
        close()
    return packs, excluded, stats


@settings(max_examples=60, deadline=None)
@given(packing_problems())
def test_packs_equal_a_naive_reference_of_the_rules(problem):
    counts, groups, mandatory, budgets = problem
    result = pack_samples(counts, groups, mandatory=mandatory, **budgets)
    expected, excluded, stats = reference_packs(counts, groups, mandatory, **budgets)
    assert packs(result) == expected
    assert result.excluded.tolist() == excluded
    assert {k: result.stats[k] for k in stats} == stats


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_counts_that_share_a_buffer_bin_still_equal_the_reference(data):
    """Budgets past the kernel's 2^16 bins put 2^shift neighbouring counts in one bin of the deferral
    buffer (here 4: counts within a few tokens of 2^17), which is then scanned: the largest fitting item,
    earliest among equal counts, is still the one taken."""
    base = 1 << 17
    n = data.draw(st.integers(0, 80))
    near = st.integers(base - 6, base + 6)
    counts = np.array(data.draw(st.lists(near | st.integers(0, 9), min_size=n, max_size=n)), dtype=np.int64)
    groups = np.array(data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), dtype=np.int32)
    mandatory = data.draw(st.lists(st.booleans(), min_size=2, max_size=2))
    max_num_tokens = data.draw(st.integers(base + 6, 3 * base + 20))
    budgets = {"max_num_tokens": max_num_tokens,
               "expected_num_tokens": data.draw(st.integers(1, max_num_tokens)),
               "max_num_tokens_per_sample": base + data.draw(st.integers(-3, 6)),
               "prefer_buffer_before": data.draw(st.integers(0, max_num_tokens)),
               "max_buffer_size": data.draw(st.integers(0, 8))}
    result = pack_samples(counts, groups, mandatory=mandatory, **budgets)
    expected, excluded, stats = reference_packs(counts, groups, mandatory, **budgets)
    assert packs(result) == expected
    assert result.excluded.tolist() == excluded
    assert {k: result.stats[k] for k in stats} == stats
