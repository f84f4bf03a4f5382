"""mmidx's GPT indices against the real megatron-core 0.16 (helpers_cpp, gpt_dataset, GPTDataset)."""

import types

import megatron.core.datasets.helpers as helpers
import numpy as np
import pytest
import torch
from megatron.core.datasets import gpt_dataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split

from mmidx import _index
from mmidx.index.gpt import build_document_index, build_sample_index, build_shuffle_index, gpt_indices, legacy_shuffle


def assert_same_state(a: np.random.RandomState, b: np.random.RandomState) -> None:
    state_a, state_b = a.get_state(), b.get_state()
    assert state_a[0] == state_b[0] and state_a[2:] == state_b[2:]
    np.testing.assert_array_equal(state_a[1], state_b[1])


def assert_identical(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(ours, theirs)


def write_indexed_dataset(prefix: str, sizes: np.ndarray) -> IndexedDataset:
    """A Megatron IndexedDataset with one sequence per document, written by Megatron's builder."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for size in sizes:
        builder.add_item(torch.zeros(int(size), dtype=torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


def megatron_gpt_dataset(
    dataset, prefix, cache, documents, num_samples, *, seed, seq_length, add_extra, drop_last
):
    """A real GPTDataset; ``drop_last=False`` is only reachable through the validation split."""
    tokenizer = types.SimpleNamespace(vocab_size=128, eod=0, pad=1, unique_identifiers={"class": "Mock"})
    config = gpt_dataset.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split="1,0,0",
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        add_extra_token_to_sequence=add_extra,
        drop_last_partial_validation_sequence=drop_last,
        # Megatron's cache key ignores add_extra_token and drop_last: one cache per dataset here.
        path_to_cache=cache,
    )
    split = Split.train if drop_last else Split.valid
    return gpt_dataset.GPTDataset(dataset, prefix, documents, num_samples, split, config)


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64, np.uint8, np.float64])
def test_legacy_shuffle_gives_randomstate_permutation_and_state(dtype):
    for seed in range(6):
        for n in [0, 1, 2, 3, 63, 64, 65, 129, 1000, 5003]:
            theirs = np.arange(n).astype(dtype)
            ours = theirs.copy()
            numpy_state, our_state = np.random.RandomState(seed), np.random.RandomState(seed)
            numpy_state.shuffle(theirs)
            legacy_shuffle(our_state, ours)
            np.testing.assert_array_equal(ours, theirs)
            assert_same_state(our_state, numpy_state)


@pytest.mark.parametrize("dtype", [np.complex128, object])
def test_legacy_shuffle_refuses_elements_it_cannot_swap_as_plain_integers_and_says_what_to_use(dtype):
    with pytest.raises(TypeError, match=f"handles plain 1-, 2-, 4- or 8-byte elements, not {np.dtype(dtype)}; use "
                                        "random_state.shuffle for this array"):
        legacy_shuffle(np.random.RandomState(0), np.zeros(3, dtype))


def test_legacy_shuffle_continues_a_used_random_state():
    numpy_state, our_state = np.random.RandomState(5), np.random.RandomState(5)
    numpy_state.random_sample(7)
    our_state.random_sample(7)
    theirs = np.arange(10_000, dtype=np.int64)
    ours = theirs.copy()
    numpy_state.shuffle(theirs)
    legacy_shuffle(our_state, ours)
    np.testing.assert_array_equal(ours, theirs)
    assert numpy_state.randint(1 << 30) == our_state.randint(1 << 30)


@pytest.mark.parametrize("maximum", [0, 1, 6, 2**31, 2**32 - 1, 2**32, 2**40 + 3, 2**63 + 5])
def test_random_interval_draws_like_legacy_bounded_integers_in_32_and_64_bit(maximum):
    # RandomState.randint uses the same masked rejection: 32-bit draws up to 2**32 - 1, then 64-bit.
    numpy_state, our_state = np.random.RandomState(11), np.random.RandomState(11)
    theirs = [int(numpy_state.randint(0, maximum + 1, dtype=np.uint64)) for _ in range(40)]
    ours = [_index.random_interval(our_state, maximum) for _ in range(40)]
    assert ours == theirs
    assert_same_state(our_state, numpy_state)


def test_legacy_shuffle_refuses_arrays_it_cannot_shuffle_in_place():
    with pytest.raises(ValueError, match="C-contiguous"):
        legacy_shuffle(np.random.RandomState(0), np.arange(10)[::2])
    with pytest.raises(TypeError, match="RandomState"):
        legacy_shuffle(np.random.default_rng(0), np.arange(10))


@pytest.mark.parametrize("separate_final_epoch", [False, True])
@pytest.mark.parametrize("num_epochs", [1, 2, 3, 5])
def test_document_index_equals_megatron(num_epochs, separate_final_epoch):
    documents = np.arange(3, 400, dtype=np.int32)
    theirs_state, our_state = np.random.RandomState(42), np.random.RandomState(42)
    theirs = gpt_dataset._build_document_index(documents, num_epochs, theirs_state, separate_final_epoch)
    ours = build_document_index(documents, num_epochs, our_state, separate_final_epoch)
    assert_identical(ours, theirs)
    assert_same_state(our_state, theirs_state)


def test_document_index_widens_to_int64_instead_of_wrapping_large_ids():
    documents = np.array([0, 2**31 + 5, 7, 2**33])
    ours = build_document_index(documents, 2, np.random.RandomState(3), False)
    same_order = build_document_index(np.array([0, 1, 2, 3]), 2, np.random.RandomState(3), False)
    assert ours.dtype == np.int64
    np.testing.assert_array_equal(ours, documents[same_order])


@pytest.mark.parametrize("num_samples", [None, 1, 40, 199])
def test_shuffle_index_equals_megatron(num_samples):
    total = 200
    first = total if num_samples is None else num_samples
    theirs_state, our_state = np.random.RandomState(9), np.random.RandomState(9)
    assert_identical(
        build_shuffle_index(first, total, our_state),
        gpt_dataset._build_shuffle_index(first, total, theirs_state),
    )
    assert_same_state(our_state, theirs_state)


def test_sample_index_equals_megatron_helpers_on_random_inputs():
    rng = np.random.default_rng(0)
    for _ in range(150):
        sizes = rng.integers(1, 80, int(rng.integers(1, 60))).astype(np.int32)
        seq_length = int(rng.integers(2, 50))
        num_epochs = int(rng.integers(1, 6))
        tokens_per_epoch = int(sizes.sum())
        if tokens_per_epoch < 2:
            continue
        state = np.random.RandomState(1)
        document_index = build_document_index(np.arange(len(sizes)), num_epochs, state, False)
        for drop_last in (True, False):
            for add_extra in (True, False):
                theirs = helpers.build_sample_idx(
                    sizes, document_index, seq_length, num_epochs, tokens_per_epoch, drop_last, add_extra
                )
                ours = build_sample_index(
                    sizes, document_index, seq_length, num_epochs, tokens_per_epoch,
                    drop_last=drop_last, add_extra_token=add_extra,
                )  # fmt: skip
                assert_identical(ours, theirs)


def test_sample_index_int64_kernel_equals_megatron_int64_kernel():
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 300, 500).astype(np.int32)
    document_index = build_document_index(np.arange(500), 3, np.random.RandomState(2), False)
    tokens_per_epoch = int(sizes.sum())
    for drop_last in (True, False):
        theirs = helpers.build_sample_idx_int64(sizes, document_index, 97, 3, tokens_per_epoch, drop_last, 1)
        count = _index.sample_count(3, tokens_per_epoch, 97, drop_last, 1)
        ours = np.empty((count + 1, 2), dtype=np.int64)
        assert _index.build_sample_index(sizes, document_index, 97, 1, ours) == -1
        assert_identical(ours, theirs)


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.uint32])
def test_sample_index_takes_sizes_and_documents_of_any_integer_dtype(dtype):
    sizes, document_index = np.array([30, 7, 12, 50], dtype), np.array([2, 0, 3, 1], dtype)
    theirs = helpers.build_sample_idx(sizes.astype(np.int32), document_index.astype(np.int32), 16, 1, 99, False,
                                      True)
    assert_identical(build_sample_index(sizes, document_index, 16, 1, 99, drop_last=False), theirs)


def test_sample_index_reproduces_single_precision_ceil_that_undercounts():
    # 2**25 + 1 tokens after the extra one: float32 rounds to 2**25, one sample fewer than exact.
    sizes = np.array([2**24, 2**24, 2], dtype=np.int32)
    document_index = np.array([0, 1, 2], dtype=np.int32)
    theirs = helpers.build_sample_idx(sizes, document_index, 4096, 1, int(sizes.sum()), False, True)
    ours = build_sample_index(sizes, document_index, 4096, 1, int(sizes.sum()), drop_last=False)
    assert len(ours) - 1 == -(-(int(sizes.sum()) - 1) // 4096) - 1
    assert_identical(ours, theirs)


def test_sample_index_reproduces_single_precision_ceil_that_overruns_the_documents():
    # 68226300 = 4050 * 16846 tokens, but float32 rounds the quotient up: one extra sample made of
    # the end-of-documents row.
    sizes = np.array([20_000_000, 20_000_000, 28_226_300], dtype=np.int32)
    document_index = np.array([2, 0, 1], dtype=np.int32)
    theirs = helpers.build_sample_idx(sizes, document_index, 4050, 1, int(sizes.sum()), False, False)
    ours = build_sample_index(
        sizes, document_index, 4050, 1, int(sizes.sum()), drop_last=False, add_extra_token=False
    )
    assert len(ours) - 1 == 16847
    assert_identical(ours, theirs)
    np.testing.assert_array_equal(ours[-2:], [[2, 20_000_000], [2, 20_000_000]])


def test_sample_index_refuses_document_ids_outside_sizes():
    with pytest.raises(IndexError, match=r"document_index\[3\] = 9"):
        build_sample_index(np.full(5, 10, np.int32), np.array([1, 2, 0, 9, 4]), 4, 1, 50)


def test_sample_index_refuses_a_negative_offset_after_an_empty_last_document():
    # Megatron's helpers write offset -1 here and its wrapper asserts.
    with pytest.raises(ValueError, match="offset -1"):
        build_sample_index(np.array([8, 0], np.int32), np.array([0, 1]), 3, 1, 8, drop_last=False)


@pytest.mark.parametrize(
    ("num_samples", "add_extra", "drop_last"),
    [
        (None, True, True),
        (None, False, False),
        (60, True, True),  # below one epoch
        (250, True, False),  # 2 epochs, final epoch separate
        (330, False, True),  # 2 epochs, final epoch shuffled with the rest
        (700, True, True),  # 4 epochs
        (900, False, False),  # 5 epochs
    ],
)
def test_gpt_indices_equal_megatron_gpt_dataset(tmp_path, num_samples, add_extra, drop_last):
    rng = np.random.default_rng(num_samples or 0)
    sizes = rng.integers(1, 120, 300)
    prefix = str(tmp_path / "corpus")
    dataset = write_indexed_dataset(prefix, sizes)
    documents = np.arange(20, 290, dtype=np.int32)
    for seed in (0, 1234):
        theirs = megatron_gpt_dataset(
            dataset, prefix, str(tmp_path / f"cache{seed}"), documents, num_samples,
            seed=seed, seq_length=64, add_extra=add_extra, drop_last=drop_last,
        )  # fmt: skip
        ours = gpt_indices(
            dataset.sequence_lengths, seq_length=64, num_samples=num_samples, seed=seed,
            add_extra_token=add_extra, drop_last=drop_last, documents=documents,
        )  # fmt: skip
        expected = (theirs.document_index, theirs.sample_index, theirs.shuffle_index)
        for our_array, their_array in zip(ours, expected, strict=True):
            assert_identical(our_array, their_array)


def test_gpt_indices_separate_the_final_epoch_below_the_80_percent_threshold(tmp_path):
    # 100 documents of 50 tokens: 99 samples of 50 (+1) tokens an epoch; two epochs hold 199.
    # The final epoch is shuffled apart when it contributes fewer than int(0.8 * 99) = 79 samples.
    sizes = np.full(100, 50)
    prefix = str(tmp_path / "corpus")
    dataset = write_indexed_dataset(prefix, sizes)
    for num_samples, separate in ((99 + 78, True), (99 + 79, False)):
        _, _, shuffle_index = gpt_indices(sizes, seq_length=50, num_samples=num_samples, seed=3)
        theirs = megatron_gpt_dataset(
            dataset, prefix, str(tmp_path / str(num_samples)), np.arange(100, dtype=np.int32), num_samples,
            seed=3, seq_length=50, add_extra=True, drop_last=True,
        )  # fmt: skip
        assert_identical(shuffle_index, theirs.shuffle_index)
        assert len(shuffle_index) == 199
        assert (set(shuffle_index[:99].tolist()) == set(range(99))) == separate


def test_gpt_indices_with_int32_sizes_beyond_2_31_tokens_equal_megatron():
    sizes = np.array([2**30, 2**30 - 3, 2**30 + 7, 2**29, 2**30], dtype=np.int32)
    documents = np.arange(5)
    seq_length = 2**20
    ours = gpt_indices(sizes, seq_length=seq_length, num_samples=13000, seed=5, documents=documents)
    state = np.random.RandomState(5)
    tokens_per_epoch = int(sizes.sum())
    assert tokens_per_epoch > 2**32
    num_epochs = 3  # 13000 * 2**20 + 1 tokens over 4.5 * 2**30 + 4 an epoch; final epoch not separate
    document_index = gpt_dataset._build_document_index(documents.astype(np.int32), num_epochs, state, False)
    sample_index = helpers.build_sample_idx(sizes, document_index, seq_length, num_epochs, tokens_per_epoch)
    shuffle_index = gpt_dataset._build_shuffle_index(len(sample_index) - 1, len(sample_index) - 1, state)
    for our_array, their_array in zip(ours, (document_index, sample_index, shuffle_index), strict=True):
        assert_identical(our_array, their_array)


def test_gpt_indices_with_int64_sizes_beyond_int32_keep_every_sample_exactly_seq_length_apart():
    # Documents longer than int32 (Megatron cannot hold them) force the int64 sample index.
    sizes = np.array([3 * 2**31 + 11, 5, 2**32 + 3, 2**31], dtype=np.int64)
    seq_length = 2**28 + 7
    document_index, sample_index, shuffle_index = gpt_indices(
        sizes, seq_length=seq_length, num_samples=100, seed=1, add_extra_token=True
    )
    assert sample_index.dtype == np.int64
    starts = np.concatenate(([0], np.cumsum(sizes[document_index])))
    positions = starts[sample_index[:, 0]] + sample_index[:, 1]
    # Row k is where sample k starts; the last row is where the last sample's extra token sits.
    assert np.all(np.diff(positions) == seq_length)
    assert positions[-1] + 1 <= starts[-1] < positions[-1] + 1 + seq_length
    assert sorted(shuffle_index.tolist()) == list(range(len(sample_index) - 1))
