"""The stream's values pinned: the per-group shuffle keys, the permutations, the mixture's draws and a pack
index's sample order for a small fixed config and seed equal golden values, which the plain-Python reference of
the documented rules (tests/support/stream_reference.py, no mmidx code) computed once and still computes. A
change of any of them changes what every run trains on, and what a resume continues: it must be deliberate."""

import itertools

import numpy as np
import pytest
from support import stream_reference as reference

from mmidx import _stream
from mmidx.config import DataConfig
from mmidx.index.cache import ArraySink
from mmidx.index.pack_index import write_pack_index
from mmidx.index.schedule import Phase, PhasedBlend
from mmidx.index.stream import ViewTable, _group_keys, multimodal_stream

# SeedSequence([seed, group]).generate_state(1, np.uint64) for seeds 0 and 3, groups 0-2
GOLDEN_KEYS = {0: [0xDB2CD7E7B0F478BE, 0x50FF846CEC53F444, 0xEEA20BBDBB39A27F],
               3: [0xAD068D6F5DFD711B, 0x9E910D331B402B88, 0x9F41EB93393D7869]}

# multimodal_stream([5, 3, 8, 1], [0.5, 0.2, 0.3, 0.1], 40, seed=3)
SIZES, WEIGHTS, SEED = [5, 3, 8, 1], [0.5, 0.2, 0.3, 0.1], 3
GOLDEN_GROUPS = [0, 2, 1, 0, 3, 2, 0, 1, 0, 2, 0, 0, 2, 1, 0, 3, 2, 0, 1, 0,
                 2, 0, 0, 2, 1, 0, 3, 2, 0, 1, 0, 2, 0, 0, 2, 1, 0, 3, 2, 0]
GOLDEN_SAMPLES = [0, 5, 1, 1, 0, 1, 2, 2, 4, 2, 3, 0, 6, 0, 4, 0, 3, 3, 2, 2,
                  7, 1, 3, 0, 0, 4, 0, 4, 1, 1, 2, 0, 0, 4, 7, 2, 2, 0, 4, 1]
GOLDEN_EPOCHS = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 1, 1, 1,
                 0, 1, 2, 0, 1, 2, 2, 0, 2, 1, 2, 1, 2, 3, 1, 2, 3, 3, 1, 3]

# A schedule of three phases, 12, 8 and 20 items: the groups drawn, and the packs they make (4 items of 10 tokens
# fill each pack of 40, so phase ends at packs 3 and 5 are at items 12 and 20), samples numbered across groups
PHASES = [([1.0, 0.0, 2.0, 1.0], 12), ([0.0, 1.0, 3.0, 0.0], 8), ([2.0, 1.0, 1.0, 0.5], 20)]
GOLDEN_DRAWS = [2, 0, 3, 2, 0, 2, 3, 2, 0, 2, 3, 2, 2, 1, 2, 2, 1, 2, 2, 2,
                0, 1, 2, 3, 0, 0, 1, 2, 0, 0, 1, 2, 3, 0, 0, 1, 2, 0, 0, 1]
GOLDEN_PACKS = [[13, 0, 16, 9], [1, 10, 16, 14], [2, 11, 16, 15], [8, 6, 12, 8], [7, 15, 12, 13], [4, 5, 11, 16],
                [3, 0, 7, 10], [4, 3, 5, 9], [16, 2, 1, 6], [14, 3, 4, 7]]


@pytest.mark.parametrize("seed", sorted(GOLDEN_KEYS))
def test_each_groups_shuffle_key_is_its_seed_sequence_word(seed):
    assert [reference.group_key(seed, group) for group in range(3)] == GOLDEN_KEYS[seed]
    assert _group_keys(seed, 3).tolist() == GOLDEN_KEYS[seed]


def test_the_stream_of_a_small_config_is_the_golden_one():
    assert reference.stream(SIZES, [(WEIGHTS, 40)], SEED) == list(zip(GOLDEN_GROUPS, GOLDEN_SAMPLES, GOLDEN_EPOCHS,
                                                                    strict=True))
    groups, samples, epochs = multimodal_stream(SIZES, WEIGHTS, 40, SEED)
    assert (groups.tolist(), samples.tolist(), epochs.tolist()) == (GOLDEN_GROUPS, GOLDEN_SAMPLES, GOLDEN_EPOCHS)


@pytest.mark.parametrize("case", range(6))
def test_the_stream_equals_the_reference_over_random_groups_weights_and_seeds(case):
    rng = np.random.default_rng(case)
    count = int(rng.integers(1, 5))
    sizes = [int(n) for n in rng.integers(1, 700, count)]
    sizes[0] = [1, 2, 1 << 9, (1 << 9) + 1, 3, 1000][case]  # power-of-two domains and cycle walks, n of 1
    weights, seed = rng.random(count).tolist(), int(rng.integers(0, 1 << 32))
    groups, samples, epochs = multimodal_stream(sizes, weights, 600, seed)
    assert list(zip(groups.tolist(), samples.tolist(), epochs.tolist(), strict=True)) == reference.stream(
        sizes, [(weights, 600)], seed)


def test_any_item_of_a_group_far_into_the_stream_is_the_references():
    """The kernel's place of the j-th item of a group, for j of late epochs and groups of up to 2**40 samples
    (keys from the reference: the kernel's permutation alone)."""
    rng = np.random.default_rng(7)
    sizes = np.array([1, 6, (1 << 20) + 7, 1 << 40], np.int64)
    keys = np.array([reference.group_key(11, group) for group in range(len(sizes))], np.uint64)
    for group, size in enumerate(sizes.tolist()):
        taken = np.sort(rng.integers(0, size * 1000, 50)).astype(np.int64)
        samples, epochs = np.empty(50, np.int64), np.empty(50, np.int64)
        _stream.stream_samples(np.full(50, group, np.int32), taken, sizes, keys, samples, epochs)
        expected = [reference.group_sample(11, group, size, int(j)) for j in taken]
        assert list(zip(samples.tolist(), epochs.tolist(), strict=True)) == expected, group


def test_the_mixtures_draws_are_the_golden_ones():
    """Each phase blends its groups of positive weight with its own error terms; a group's items continue
    its count across phases (the ranks)."""
    assert reference.phased_groups(PHASES) == GOLDEN_DRAWS
    phases = [Phase(tuple(weights), None if number == len(PHASES) - 1 else 1) for number, (weights, _) in
              enumerate(PHASES)]  # the limits are the packer's: here each phase ends where the test says
    blend = PhasedBlend(phases, len(SIZES))
    drawn, ranks = [], []
    for number, (_, length) in enumerate(PHASES):
        if number:
            blend.next_phase()
        for part in (length // 3, length - length // 3):  # taken in two calls: the phase's state carries over
            groups, group_ranks = blend.take(part)
            drawn += groups.tolist()
            ranks += group_ranks.tolist()
    assert drawn == GOLDEN_DRAWS
    assert ranks == [GOLDEN_DRAWS[:i].count(group) for i, group in enumerate(GOLDEN_DRAWS)]


def test_a_scheduled_pack_index_of_a_small_config_holds_the_golden_packs():
    """Through the pack index's own path (a data config's groups, schedule and seed): 10 packs of 4 items."""
    config = DataConfig.from_dict({
        "groups": {name: {"datasets": [f"unused-{name}"]} for name in ("a", "b", "c", "d")},
        "packing": {"max_num_tokens": 40, "expected_num_tokens": 40, "max_num_tokens_per_sample": 40,
                    "prefer_buffer_before": 30, "max_buffer_size": 4},
        "seed": SEED,
        "schedule": [{"until": {"packs": 3}, "weights": dict(zip("abcd", PHASES[0][0], strict=True))},
                     {"until": {"packs": 5}, "weights": dict(zip("abcd", PHASES[1][0], strict=True))},
                     {"weights": dict(zip("abcd", PHASES[2][0], strict=True))}]})
    table = ViewTable.of([np.arange(n + 1) for n in SIZES], [np.full(n, 10) for n in SIZES])
    sink = ArraySink(None)
    write_pack_index(sink, table, config, 40)
    arrays = sink.finish()
    offsets, samples = arrays["pack_offsets"].astype(np.int64), arrays["samples"].astype(np.int64)
    packs = [samples[a:b].tolist() for a, b in itertools.pairwise(offsets)]
    base = np.concatenate([[0], np.cumsum(SIZES)])
    items = reference.stream(SIZES, PHASES, SEED)
    numbered = [int(base[group]) + sample for group, sample, _ in items]
    assert [numbered[k:k + 4] for k in range(0, 40, 4)] == GOLDEN_PACKS
    assert packs == GOLDEN_PACKS
