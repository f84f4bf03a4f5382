"""Blending against megatron-core 0.16's helpers_cpp, and the multimodal stream built on it."""

import megatron.core.datasets.helpers as helpers
import numpy as np
import pytest
from megatron.core.datasets.utils import normalize

from mmidx.index.blend import blending_indices, exhaustive_blending_indices
from mmidx.index.stream import multimodal_stream, stream_views


def megatron_blend(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """What BlendedDataset builds for ``size`` samples: normalize, then helpers_cpp."""
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        dataset_index, dataset_sample_index, normalize(list(weights)), len(weights), size, False
    )
    return dataset_index, dataset_sample_index


def megatron_exhaustive_blend(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What BlendedDataset builds with ``size=None``: every sample of every dataset."""
    dataset_index = np.zeros(int(sizes.sum()), dtype=np.int16)
    dataset_sample_index = np.zeros(int(sizes.sum()), dtype=np.int64)
    helpers.build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, len(sizes))
    return dataset_index, dataset_sample_index


def assert_identical(ours: tuple, theirs: tuple) -> None:
    for our_array, their_array in zip(ours, theirs, strict=True):
        assert our_array.dtype == their_array.dtype
        np.testing.assert_array_equal(our_array, their_array)


@pytest.mark.parametrize("num_datasets", [2, 10, 100])
def test_blending_indices_equal_megatron(num_datasets):
    rng = np.random.default_rng(num_datasets)
    for _ in range(3):
        weights = rng.random(num_datasets) + 1e-3
        assert_identical(blending_indices(weights, 20_000), megatron_blend(weights, 20_000))


def test_blending_indices_equal_megatron_for_integer_and_skewed_weights():
    for weights in ([3, 1], [1, 1, 1], [1e-6, 1.0, 5.0], [0.7, 0.2, 0.1]):
        assert_identical(blending_indices(weights, 5_000), megatron_blend(np.array(weights, float), 5_000))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint8])
def test_blending_indices_equal_megatron_for_weights_of_any_numeric_dtype(dtype):
    """Megatron's normalize divides in float64 whatever the weights' dtype (a config's float32 weights too)."""
    weights = np.array([0.7, 0.2, 0.1], dtype) if np.issubdtype(dtype, np.floating) else np.array([5, 3, 1], dtype)
    assert_identical(blending_indices(weights, 5_000), megatron_blend(weights, 5_000))


@pytest.mark.parametrize("num_datasets", [2, 10, 100])
def test_exhaustive_blending_indices_equal_megatron(num_datasets):
    rng = np.random.default_rng(num_datasets + 1)
    sizes = rng.integers(1, 400, num_datasets).astype(np.int64)
    assert_identical(exhaustive_blending_indices(sizes), megatron_exhaustive_blend(sizes))


def test_exhaustive_blending_takes_every_sample_of_every_dataset_once():
    sizes = np.array([5, 1, 17, 3])
    dataset_index, dataset_sample_index = exhaustive_blending_indices(sizes)
    for dataset, size in enumerate(sizes):
        np.testing.assert_array_equal(dataset_sample_index[dataset_index == dataset], np.arange(size))


def test_blending_sample_index_counts_earlier_samples_of_the_same_dataset():
    dataset_index, dataset_sample_index = blending_indices([0.5, 0.3, 0.2], 3_000)
    assert dataset_sample_index.dtype == np.int64
    for dataset in range(3):
        np.testing.assert_array_equal(
            dataset_sample_index[dataset_index == dataset], np.arange(np.sum(dataset_index == dataset))
        )


def test_blending_keeps_int16_up_to_32767_datasets_and_widens_beyond():
    assert blending_indices(np.ones(32_767), 3)[0].dtype == np.int16
    weights = np.ones(40_000)
    weights[39_999] = 1e6  # so the first sample comes from the last dataset
    dataset_index, _ = blending_indices(weights, 3)
    assert dataset_index.dtype == np.int32
    assert dataset_index[0] == 39_999


def test_blending_refuses_non_positive_weights():
    with pytest.raises(ValueError, match="positive"):
        blending_indices([1.0, 0.0], 10)


def test_stream_interleaves_groups_in_the_greedy_blend_order():
    weights = [0.6, 0.3, 0.1]
    group_ids, _, _ = multimodal_stream([50, 20, 7], weights, 1_000, seed=3)
    assert group_ids.dtype == np.int32
    np.testing.assert_array_equal(group_ids, blending_indices(weights, 1_000)[0])


@pytest.mark.parametrize("group_size", [1, 2, 3, 16, 17, 1000])
def test_stream_visits_every_sample_once_per_epoch(group_size):
    group_ids, sample_ids, epochs = multimodal_stream([group_size, 5], [0.8, 0.2], 8 * group_size, seed=1)
    of_group = group_ids == 0
    taken = np.arange(np.sum(of_group))
    np.testing.assert_array_equal(epochs[of_group], taken // group_size)
    for epoch in range(int(epochs[of_group].max())):
        assert sorted(sample_ids[of_group][epochs[of_group] == epoch]) == list(range(group_size))


def test_stream_epochs_are_shuffled_apart():
    _, sample_ids, epochs = multimodal_stream([1000], [1.0], 3000, seed=0)
    orders = [sample_ids[epochs == epoch] for epoch in range(3)]
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])


def test_stream_is_a_pure_function_of_the_seed():
    first = multimodal_stream([40, 30], [0.5, 0.5], 500, seed=9)
    again = multimodal_stream([40, 30], [0.5, 0.5], 500, seed=9)
    other = multimodal_stream([40, 30], [0.5, 0.5], 500, seed=10)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[1], other[1])


def test_longer_stream_extends_a_shorter_one():
    short = multimodal_stream([100, 33], [0.7, 0.3], 250, seed=4)
    long = multimodal_stream([100, 33], [0.7, 0.3], 1_000, seed=4)
    for a, b in zip(short, long, strict=True):
        np.testing.assert_array_equal(a, b[:250])


def test_partial_last_epoch_draws_every_sample_equally_often_across_seeds():
    # 30 of 100 samples per seed; over 2000 seeds each sample is drawn ~600 times (sd ~ 20.5).
    hits = np.zeros(100, dtype=np.int64)
    for seed in range(2000):
        _, sample_ids, _ = multimodal_stream([100], [1.0], 30, seed=seed)
        hits[sample_ids] += 1
    assert hits.sum() == 60_000
    assert np.all(np.abs(hits - 600) < 6 * 20.5)


def test_stream_handles_groups_beyond_int32_without_materialising_them():
    group_ids, sample_ids, epochs = multimodal_stream([3 * 2**31 + 7, 4], [0.5, 0.5], 10_000, seed=2)
    big = group_ids == 0
    assert sample_ids.dtype == np.int64
    assert sample_ids[big].max() > 2**32 and sample_ids[big].max() < 3 * 2**31 + 7
    assert len(set(sample_ids[big].tolist())) == big.sum()
    assert np.all(epochs[big] == 0) and epochs[~big].max() == 5_000 // 4 - 1


def test_stream_views_are_epoch_mod_views_with_their_token_counts():
    # Group 0: sample 0 has views of 10 and 11 tokens, sample 1 one view of 20.
    # Group 1: sample 0 has three views (2**40, 5, 6): int64 counts pass through.
    view_offsets = [np.array([0, 2, 3]), np.array([0, 3])]
    view_token_counts = [np.array([10, 11, 20]), np.array([2**40, 5, 6])]
    group_ids = np.array([0, 0, 0, 1, 1, 1, 1])
    sample_ids = np.array([0, 0, 1, 0, 0, 0, 0])
    epochs = np.array([0, 3, 7, 0, 1, 2, 3])
    views, counts = stream_views(group_ids, sample_ids, epochs, view_offsets, view_token_counts)
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(views, [0, 1, 0, 0, 1, 2, 0])
    np.testing.assert_array_equal(counts, [10, 11, 20, 2**40, 5, 6, 2**40])


@pytest.mark.parametrize("sample, epoch, message", [
    (-1, 0, "a sample id is outside its group's view_offsets"),  # the kernel would read before the table
    (2, 0, "a sample id is outside its group's view_offsets"),
    (0, -1, "epochs must be non-negative"),
])
def test_stream_views_refuse_a_sample_outside_its_group_and_a_negative_epoch(sample, epoch, message):
    with pytest.raises(ValueError, match=message):
        stream_views([0], [sample], [epoch], [np.array([0, 1, 2])], [np.array([4, 5])])


def test_stream_views_refuse_a_sample_without_views():
    with pytest.raises(ValueError, match="sample 1 of group 0 has no view"):
        stream_views([0], [0], [0], [np.array([0, 1, 1])], [np.array([4])])
