"""Streamed packing (PackStream) equals the whole-array pipeline, pack for pack, at any chunk size."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mmidx.index.pack_stream import PackStream
from mmidx.index.packer import pack_samples
from mmidx.index.stream import ViewTable, multimodal_stream, stream_views


def whole_array(offsets, tokens, weights, mandatory, num_samples, seed, budgets):
    """(pack_offsets, samples numbered across groups, views, stats) of the in-memory reference."""
    groups, samples, epochs = multimodal_stream([len(o) - 1 for o in offsets], weights, num_samples, seed)
    views, counts = stream_views(groups, samples, epochs, offsets, tokens)
    packed = pack_samples(counts, groups, mandatory=mandatory, **budgets)
    base = np.concatenate(([0], np.cumsum([len(o) - 1 for o in offsets])))
    numbers = base[groups] + samples
    return packed.pack_offsets, numbers[packed.pack_items], views[packed.pack_items], packed.stats


def streamed(offsets, tokens, weights, mandatory, num_samples, seed, budgets, chunk_size):
    stream = PackStream(ViewTable.of(offsets, tokens), weights, num_samples, seed, mandatory=mandatory,
                        chunk_size=chunk_size, **budgets)
    chunks = list(stream)
    sizes = np.cumsum([0] + [len(c.samples) for c in chunks[:-1]])
    pack_offsets = np.concatenate([[0]] + [c.pack_ends + base for c, base in zip(chunks, sizes, strict=True)])
    samples = np.concatenate([c.samples for c in chunks])
    views = np.concatenate([c.views for c in chunks])
    assert sum(stream.group_counts) == num_samples
    return pack_offsets, samples, views, stream.stats


@st.composite
def problems(draw):
    num_groups = draw(st.integers(1, 3))
    offsets, tokens = [], []
    for _ in range(num_groups):
        views = draw(st.lists(st.integers(1, 3), min_size=1, max_size=12))
        offsets.append(np.concatenate([[0], np.cumsum(views)]))
        tokens.append(np.array(draw(st.lists(st.integers(0, 45), min_size=sum(views), max_size=sum(views)))))
    weights = draw(st.lists(st.floats(0.05, 1.0), min_size=num_groups, max_size=num_groups))
    mandatory = draw(st.lists(st.booleans(), min_size=num_groups, max_size=num_groups))
    max_num_tokens = draw(st.integers(10, 60))
    budgets = {
        "max_num_tokens": max_num_tokens,
        "expected_num_tokens": draw(st.integers(1, max_num_tokens)),
        "max_num_tokens_per_sample": draw(st.integers(1, max_num_tokens)),
        "prefer_buffer_before": draw(st.integers(0, max_num_tokens + 5)),
        "max_buffer_size": draw(st.integers(0, 5)),
    }
    return offsets, tokens, weights, mandatory, draw(st.integers(0, 300)), draw(st.integers(0, 3)), budgets


@settings(max_examples=40, deadline=None)
@given(problems(), st.sampled_from([1, 2, 5, 16, 1000]))
def test_streamed_packs_equal_the_whole_array_packs(problem, chunk_size):
    reference = whole_array(*problem)
    ours = streamed(*problem, chunk_size)
    for a, b in zip(ours[:3], reference[:3], strict=True):
        np.testing.assert_array_equal(a, b)
    assert ours[3] == reference[3]


def test_a_rare_mandatory_group_runs_ahead_of_the_stream_across_many_chunks():
    # Group 1 (mandatory) is 2% of the stream, but every pack opens with one of its items, so its
    # lookahead runs far past the chunk being packed, then it runs dry and packs go on without it.
    offsets = [np.arange(51), np.arange(8), np.arange(31)]
    tokens = [np.full(50, 9), np.full(7, 3), np.arange(30) % 11]
    budgets = {"max_num_tokens": 20, "expected_num_tokens": 18, "max_num_tokens_per_sample": 20,
               "prefer_buffer_before": 10, "max_buffer_size": 2}
    problem = (offsets, tokens, [0.6, 0.02, 0.38], [False, True, True], 2000, 7, budgets)
    reference = whole_array(*problem)
    for chunk_size in (3, 64):
        ours = streamed(*problem, chunk_size)
        for a, b in zip(ours[:3], reference[:3], strict=True):
            np.testing.assert_array_equal(a, b)
        assert ours[3] == reference[3]


def test_a_full_buffer_at_every_chunk_boundary_carries_over():
    # Items of 8 never fit beside a 9: with max_buffer_size 3 the buffer is near full all the time,
    # and a chunk of 4 cuts the stream at every buffer state.
    offsets = [np.arange(11), np.arange(11)]
    tokens = [np.full(10, 9), np.full(10, 8)]
    budgets = {"max_num_tokens": 16, "expected_num_tokens": 16, "max_num_tokens_per_sample": 16,
               "prefer_buffer_before": 16, "max_buffer_size": 3}
    problem = (offsets, tokens, [0.5, 0.5], [True, False], 200, 1, budgets)
    reference = whole_array(*problem)
    assert reference[3]["solo_packs"] > 0 and reference[3]["max_deferral"] > 2
    ours = streamed(*problem, 4)
    for a, b in zip(ours[:3], reference[:3], strict=True):
        np.testing.assert_array_equal(a, b)
    assert ours[3] == reference[3]
