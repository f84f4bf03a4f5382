"""Streamed packing (PackStream) equals the whole-array pipeline, pack for pack, at any chunk size."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from support.streams import problems, streamed, whole_array


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
