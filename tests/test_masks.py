"""Specification of ``mmidx.pack.masks``: BAGEL's attention rule as dense masks, a mask_mod and a BlockMask.

Every check compares against ``naive_sample_mask``, written here from the three steps of the rule
and nothing else. The CPU tests cover all of the code; the one CUDA test only checks that the same
code gives the same masks there, and is skipped where no GPU is present (as in CI).
"""

import random
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from mmidx import _masks
from mmidx.pack.masks import _device_dense_masks, _Layout, block_mask, dense_masks, mask_predicate

MODES = ("causal", "full", "noise")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
HYPOTHESIS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- the reference -----------------------------------------------------------------------------


def naive_sample_mask(split_lens, attn_modes):
    """The rule within one sample, step by step, on a boolean matrix (True = may attend)."""
    length = sum(split_lens)
    allowed = torch.zeros(length, length, dtype=torch.bool)
    start = 0
    for size, mode in zip(split_lens, attn_modes, strict=True):
        rows = slice(start, start + size)
        allowed[rows, :start] = True  # steps 1 and 2: every earlier split
        if mode == "causal":  # step 1: lower-triangular within itself
            allowed[rows, rows] = torch.ones(size, size, dtype=torch.bool).tril()
        else:  # step 2: its whole own block
            allowed[rows, rows] = True
        start += size
    start = 0
    for size, mode in zip(split_lens, attn_modes, strict=True):
        cols = slice(start, start + size)
        if mode == "noise":  # step 3: only the noise split itself sees its columns
            allowed[:, cols] = False
            allowed[cols, cols] = True
        start += size
    return allowed


def flatten(samples):
    """A pack given as samples (lists of (length, mode)) -> (split_lens, attn_modes, sample_lens)."""
    split_lens = [size for sample in samples for size, _ in sample]
    attn_modes = [mode for sample in samples for _, mode in sample]
    return split_lens, attn_modes, [sum(size for size, _ in sample) for sample in samples]


def naive_sample_masks(samples):
    return [naive_sample_mask([s for s, _ in sample], [m for _, m in sample]) for sample in samples]


def naive_pack_mask(samples):
    """The whole pack: the samples' masks on the diagonal, nothing across samples."""
    return torch.block_diag(*naive_sample_masks(samples)) if samples else torch.zeros(0, 0, dtype=torch.bool)


def additive(allowed, dtype):
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}[actual.dtype]
    assert torch.equal(actual.view(bits), expected.view(bits))


def assert_same_block_mask(actual, expected):
    """Equal block lists (the meaningful prefix of each row), counts, shapes and dtypes."""
    assert actual.seq_lengths == expected.seq_lengths and actual.BLOCK_SIZE == expected.BLOCK_SIZE
    for name in ("kv", "full_kv", "q", "full_q"):
        num, idx = getattr(actual, f"{name}_num_blocks"), getattr(actual, f"{name}_indices")
        ref_num, ref_idx = getattr(expected, f"{name}_num_blocks"), getattr(expected, f"{name}_indices")
        assert num.dtype == ref_num.dtype and idx.dtype == ref_idx.dtype
        assert num.shape == ref_num.shape and idx.shape == ref_idx.shape
        assert torch.equal(num, ref_num), name
        prefix = torch.arange(idx.shape[-1]) < num[..., None]
        assert torch.equal(idx[prefix], ref_idx[prefix]), name


# --- layouts -----------------------------------------------------------------------------------


def split_strategy(max_len):
    """A split: often tiny or at a block boundary, else any length up to max_len; any mode."""
    edges = [n for n in (15, 16, 17, 31, 32, 33, 127, 128, 129) if n <= max_len]
    sizes = st.one_of(st.integers(0, 3), st.integers(0, max_len), st.sampled_from(edges))
    return st.tuples(sizes, st.sampled_from(MODES))


def pack_strategy(max_len, max_splits, max_samples):
    """Random samples of random splits, maybe followed by BAGEL's padding pseudo-sample."""
    samples = st.lists(
        st.lists(split_strategy(max_len), max_size=max_splits), min_size=1, max_size=max_samples
    )
    padding = st.one_of(st.none(), st.integers(0, 150).map(lambda n: [[(n, "causal")]]))
    return st.builds(lambda s, p: s + (p or []), samples, padding)


def bagel_pack(total, seed):
    """A realistic flex-mode pack: t2i, edit and vlm samples, then the causal padding pseudo-sample."""
    rng = random.Random(seed)

    def text():
        return [(rng.randint(5, 300) + 2, "causal")]

    def vae(mode):
        return [(rng.choice([32, 48, 64]) * rng.choice([32, 48]) + 2, mode)]

    def vit():
        return [(rng.choice([27, 37, 50]) ** 2 + 2, "full")]

    samples = []
    while True:
        kind = rng.choice(["t2i", "edit", "vlm"])
        if kind == "t2i":
            sample = text() + vae("noise")
        elif kind == "edit":
            sample = vae("full") + vit() + text() + vae("noise") + [(0, "full")] + text() + vae("noise")
        else:
            sample = text() + vit() + text() + text() + text()
        if sum(s for s, _ in sample) + sum(s for p in samples for s, _ in p) > total:
            break
        samples.append(sample)
    used = sum(s for p in samples for s, _ in p)
    return [*samples, [(total - used, "causal")]]


# --- the predicate -----------------------------------------------------------------------------


def test_predicate_on_a_worked_example():
    # causal 2 | full 2 | noise 2 | causal 1, one sample; rows attend to the columns marked 1.
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    split_lens, attn_modes = [2, 2, 2, 1], ["causal", "full", "noise", "causal"]
    assert torch.equal(naive_sample_mask(split_lens, attn_modes), expected)
    predicate = mask_predicate(split_lens, attn_modes, [7], device="cpu")
    q = torch.arange(7)
    assert torch.equal(predicate(None, None, q[:, None], q[None, :]), expected)


@HYPOTHESIS
@given(pack_strategy(max_len=60, max_splits=6, max_samples=4))
def test_predicate_equals_the_rule_at_every_position(samples):
    split_lens, attn_modes, sample_lens = flatten(samples)
    predicate = mask_predicate(split_lens, attn_modes, sample_lens, device="cpu")
    positions = torch.arange(sum(sample_lens))
    actual = predicate(None, None, positions[:, None], positions[None, :])
    assert torch.equal(actual, naive_pack_mask(samples))


# --- dense masks -------------------------------------------------------------------------------


@HYPOTHESIS
@given(pack_strategy(max_len=300, max_splits=5, max_samples=4), st.sampled_from(DTYPES))
def test_dense_masks_equal_the_rule_bit_for_bit(samples, dtype):
    split_lens, attn_modes, sample_lens = flatten(samples)
    masks = dense_masks(split_lens, attn_modes, sample_lens, device="cpu", dtype=dtype)
    assert len(masks) == len(samples)
    for mask, expected in zip(masks, naive_sample_masks(samples), strict=True):
        assert_same_bits(mask, additive(expected, dtype))


@HYPOTHESIS
@given(pack_strategy(max_len=300, max_splits=5, max_samples=4), st.sampled_from(DTYPES))
def test_dense_masks_off_the_cpu_equal_the_rule_bit_for_bit(samples, dtype):
    # the template path that GPUs run (test_cuda_masks_equal_cpu_masks runs it there), here on the CPU
    masks = _device_dense_masks(_Layout.build(*flatten(samples)), "cpu", dtype)
    for mask, expected in zip(masks, naive_sample_masks(samples), strict=True):
        assert_same_bits(mask, additive(expected, dtype))


@HYPOTHESIS
@given(
    st.lists(split_strategy(max_len=80).filter(lambda split: split[0] > 0), min_size=1, max_size=6),
    st.sampled_from(DTYPES),
    st.integers(0, 15),
)
def test_the_run_kernel_writes_its_mask_and_nothing_else_at_any_alignment(sample, dtype, offset):
    # rows of 1 to 480 tokens start anywhere in a cache line: the streaming stores' aligned body, the bytes
    # around it and the pattern's rotation to an odd address are all exercised, around sentinel bytes
    expected = additive(naive_sample_mask([s for s, _ in sample], [m for _, m in sample]), dtype)
    expected = expected.view(torch.uint8).reshape(-1).numpy()
    memory = np.full(len(expected) + 32, 0xA5, np.uint8)
    out = memory[offset:offset + len(expected)]
    ends = np.cumsum([size for size, _ in sample])
    causal = np.array([mode == "causal" for _, mode in sample], np.uint8)
    noise = np.array([mode == "noise" for _, mode in sample], np.uint8)
    attend, blocked = (int.from_bytes(torch.full((1,), value, dtype=dtype).view(torch.uint8).numpy().tobytes()
                                      * (8 // dtype.itemsize), sys.byteorder) for value in (0.0, float("-inf")))
    _masks.fill_sample_mask(out, ends, causal, noise, attend, blocked, dtype.itemsize)
    assert np.array_equal(out, expected)
    assert (memory[:offset] == 0xA5).all() and (memory[offset + len(expected):] == 0xA5).all()


@pytest.mark.parametrize(
    ("ends", "causal", "noise", "nbytes", "itemsize", "message"),
    [
        ([2, 5], [1, 0], [0, 1], 99, 4, "out holds 99 bytes, not the 100"),
        ([2, 2, 5], [1, 0, 0], [0, 0, 1], 100, 4, "split 1 is empty"),
        ([3, 2], [1, 0], [0, 1], 16, 4, "split 1 is empty, ends before"),
        ([2, 5], [1, 2], [0, 1], 100, 4, "other than 0 or 1"),
        ([2, 5], [1], [0, 1], 100, 4, "differ in length"),
        ([2, 5], [1, 0], [0, 1], 75, 3, "itemsize must be"),
    ],
)
def test_the_run_kernel_refuses_inconsistent_inputs_and_writes_nothing(ends, causal, noise, nbytes, itemsize,
                                                                        message):
    out = np.full(nbytes, 0xA5, np.uint8)
    with pytest.raises(ValueError, match=message):
        _masks.fill_sample_mask(out, np.array(ends, np.int64), np.array(causal, np.uint8),
                                np.array(noise, np.uint8), 0, 2**64 - 1, itemsize)
    assert (out == 0xA5).all()


def test_dense_masks_are_contiguous_and_independent():
    masks = dense_masks([3, 4, 5], ["causal", "noise", "full"], [7, 5], device=torch.device("cpu"))
    assert [m.shape for m in masks] == [(7, 7), (5, 5)]
    assert all(m.is_contiguous() and m.device.type == "cpu" for m in masks)
    assert masks[0].untyped_storage().data_ptr() != masks[1].untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_dense_masks_equal_the_rule_and_share_no_memory(dtype):
    # samples of 4200+ tokens: the pack's masks are over 32 MiB, so the CPU writes them into a pooled buffer
    samples = [[(2600, "causal"), (1600, "noise"), (40, "full")], [(4200, "full"), (3, "causal")], [(5, "causal")]]
    masks = dense_masks(*flatten(samples), device="cpu", dtype=dtype)
    for mask, expected in zip(masks, naive_sample_masks(samples), strict=True):
        assert mask.is_contiguous()
        assert_same_bits(mask, additive(expected, dtype))
    assert len({mask.untyped_storage().data_ptr() for mask in masks}) == 3
    masks[0].fill_(1.0)  # writable, and shared with nothing
    assert_same_bits(masks[1], additive(naive_sample_masks(samples)[1], dtype))


def test_large_dense_masks_reuse_memory_only_once_none_of_them_is_alive():
    packs = [[[(4100, "causal"), (100, "noise")]], [[(4100, "full"), (100, "causal")]],
             [[(100, "noise"), (4100, "causal")]]]  # 67 MB of masks each, all different
    kept = [dense_masks(*flatten(samples), device="cpu") for samples in packs]  # more packs than the pool holds
    for masks, samples in zip(kept, packs, strict=True):
        assert_same_bits(masks[0], additive(naive_sample_masks(samples)[0], torch.float32))
    first, second, _ = (masks[0].data_ptr() for masks in kept)
    row = kept[0][0][7]  # a view keeps the first pack's memory in use
    del kept
    assert dense_masks(*flatten(packs[2]), device="cpu")[0].data_ptr() == second
    del row
    assert dense_masks(*flatten(packs[2]), device="cpu")[0].data_ptr() in (first, second)


def test_dense_masks_of_empty_samples_are_empty():
    masks = dense_masks([0, 4, 0], ["noise", "causal", "full"], [0, 4, 0], device="cpu")
    assert [m.shape for m in masks] == [(0, 0), (4, 4), (0, 0)]


def test_lists_arrays_and_tensors_give_the_same_masks():
    split_lens, attn_modes, sample_lens = flatten(bagel_pack(3000, seed=1))
    from_lists = dense_masks(split_lens, attn_modes, sample_lens, device="cpu")
    as_arrays = dense_masks(
        np.array(split_lens), attn_modes, np.array(sample_lens, dtype=np.int32), device="cpu"
    )
    as_tensors = dense_masks(
        torch.tensor(split_lens), tuple(attn_modes), torch.tensor(sample_lens), device="cpu"
    )
    for a, b, c in zip(from_lists, as_arrays, as_tensors, strict=True):
        assert_same_bits(a, b)
        assert_same_bits(a, c)


# --- block masks -------------------------------------------------------------------------------


@HYPOTHESIS
@given(pack_strategy(max_len=129, max_splits=5, max_samples=3), st.sampled_from([16, 32, 128]))
def test_block_mask_equals_create_block_mask(samples, block_size):
    split_lens, attn_modes, sample_lens = flatten(samples)
    length = sum(sample_lens)
    assume(length > 0)  # create_block_mask cannot vmap a lookup over no positions; see the empty-pack test
    reference = naive_pack_mask(samples)

    def naive_mod(b, h, q_idx, kv_idx):
        return reference[q_idx, kv_idx]

    actual = block_mask(split_lens, attn_modes, sample_lens, device="cpu", block_size=block_size)
    expected = create_block_mask(naive_mod, None, None, length, length, device="cpu", BLOCK_SIZE=block_size)
    assert_same_block_mask(actual, expected)
    positions = torch.arange(length)
    assert torch.equal(actual.mask_mod(None, None, positions[:, None], positions[None, :]), reference)


@pytest.mark.parametrize("block_size", [16, 128])
def test_block_mask_handles_partial_blocks_short_samples_and_padding(block_size):
    samples = [
        [(5, "causal"), (0, "noise"), (20, "noise")],  # shorter than a block, with an empty split
        [],  # an empty sample
        [(130, "full"), (3, "causal"), (40, "noise"), (7, "causal")],
        [(11, "causal")],  # BAGEL's padding pseudo-sample; L = 216 is not a multiple of the block
    ]
    split_lens, attn_modes, sample_lens = flatten(samples)
    predicate = mask_predicate(split_lens, attn_modes, sample_lens, device="cpu")
    expected = create_block_mask(predicate, None, None, 216, 216, device="cpu", BLOCK_SIZE=block_size)
    actual = block_mask(split_lens, attn_modes, sample_lens, device="cpu", block_size=block_size)
    assert_same_block_mask(actual, expected)


def test_block_mask_of_an_empty_pack():
    actual = block_mask([0], ["causal"], [0], device="cpu")
    expected = create_block_mask(lambda b, h, q, k: q >= k, None, None, 0, 0, device="cpu")
    assert_same_block_mask(actual, expected)
    assert dense_masks([0], ["causal"], [0], device="cpu")[0].shape == (0, 0)


def reference_blocks(masks, block_size):
    """(partial, full) block matrices, classified from the naive mask one block row at a time.

    A block row's strip of the mask is materialised over the kv blocks of the samples its rows
    belong to (every other column of the naive pack mask is False) and every block in it counted.
    """
    starts = np.cumsum([0] + [m.shape[0] for m in masks])
    length = int(starts[-1])
    num_blocks = -(-length // block_size)
    partial = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
    full = torch.zeros_like(partial)
    for row in range(num_blocks):
        q0, q1 = row * block_size, min(length, (row + 1) * block_size)
        hit = [i for i in range(len(masks)) if max(q0, starts[i]) < min(q1, starts[i + 1])]
        first_block = starts[hit[0]] // block_size
        cols = slice(first_block, -(-starts[hit[-1] + 1] // block_size))
        strip = torch.zeros(block_size, (cols.stop - cols.start) * block_size, dtype=torch.bool)
        for i in hit:
            lo, hi = max(q0, starts[i]), min(q1, starts[i + 1])
            c0 = starts[i] - first_block * block_size
            strip[lo - q0 : hi - q0, c0 : c0 + len(masks[i])] = masks[i][lo - starts[i] : hi - starts[i]]
        counts = strip.view(block_size, -1, block_size).sum(dim=2, dtype=torch.int32).sum(dim=0)
        full[row, cols] = counts == block_size * block_size
        partial[row, cols] = (counts > 0) & (counts < block_size * block_size)
    return partial, full


def dense_blocks(num_blocks, indices):
    """The (rows, cols) bool matrix of a BlockMask's block lists."""
    rows = indices.shape[-2]
    out = torch.zeros(rows, indices.shape[-1], dtype=torch.bool)
    listed = torch.arange(indices.shape[-1]) < num_blocks[0, 0, :, None]
    out[torch.arange(rows)[:, None].expand_as(listed)[listed], indices[0, 0][listed].long()] = True
    return out


def test_block_mask_of_a_32k_pack_equals_the_rule_block_by_block():
    samples = bagel_pack(32768 + 77, seed=0)
    split_lens, attn_modes, sample_lens = flatten(samples)
    actual = block_mask(split_lens, attn_modes, sample_lens, device="cpu")
    masks = naive_sample_masks(samples)
    partial, full = reference_blocks(masks, 128)
    assert partial.any() and full.any()
    assert torch.equal(dense_blocks(actual.kv_num_blocks, actual.kv_indices), partial)
    assert torch.equal(dense_blocks(actual.full_kv_num_blocks, actual.full_kv_indices), full)

    # the mask_mod, on random positions, against the same naive masks
    sample_of = torch.repeat_interleave(torch.arange(len(masks)), torch.tensor(sample_lens))
    starts = torch.tensor(np.cumsum([0, *sample_lens[:-1]]))
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, sum(sample_lens), (20000,), generator=generator)
    near = (q + torch.randint(-3000, 3000, q.shape, generator=generator)).clamp(0, sum(sample_lens) - 1)
    expected = torch.zeros(q.shape, dtype=torch.bool)
    for index, mask in enumerate(masks):
        pairs = (sample_of[q] == index) & (sample_of[near] == index)
        expected[pairs] = mask[q[pairs] - starts[index], near[pairs] - starts[index]]
    assert torch.equal(actual.mask_mod(None, None, q, near), expected)


def test_flex_attention_with_the_block_mask_equals_the_dense_masks():
    samples = [[(9, "causal"), (40, "full"), (30, "noise"), (7, "causal")], [(50, "noise")], [(21, "causal")]]
    split_lens, attn_modes, sample_lens = flatten(samples)
    length = sum(sample_lens)
    blocks = block_mask(split_lens, attn_modes, sample_lens, device="cpu", block_size=16)
    q, k, v = torch.randn(3, 1, 2, length, 8, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        actual = flex_attention(q, k, v, block_mask=blocks)
    dense = torch.full((length, length), float("-inf"))
    start = 0
    for mask in dense_masks(split_lens, attn_modes, sample_lens, device="cpu"):
        dense[start : start + len(mask), start : start + len(mask)] = mask
        start += len(mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(actual, expected)


# --- devices -----------------------------------------------------------------------------------


def test_cpu_masks_never_touch_cuda(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("the CPU path called into torch.cuda")

    for name in ("is_available", "synchronize", "current_device", "current_stream", "device_count"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    split_lens, attn_modes, sample_lens = flatten(bagel_pack(2000, seed=2))
    dense_masks(split_lens, attn_modes, sample_lens, device="cpu")
    block_mask(split_lens, attn_modes, sample_lens, device="cpu")


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; the CPU tests check the same rule and both dense paths (the run kernel of the CPU "
    "and the template path of other devices), but only this test runs them on a GPU",
)
def test_cuda_masks_equal_cpu_masks():
    split_lens, attn_modes, sample_lens = flatten(bagel_pack(32768, seed=3))
    for on_gpu, on_cpu in zip(
        dense_masks(split_lens, attn_modes, sample_lens, device="cuda", dtype=torch.bfloat16),
        dense_masks(split_lens, attn_modes, sample_lens, device="cpu", dtype=torch.bfloat16),
        strict=True,
    ):
        assert on_gpu.is_cuda
        assert_same_bits(on_gpu.cpu(), on_cpu)
    gpu = block_mask(split_lens, attn_modes, sample_lens, device="cuda")
    assert gpu.kv_indices.is_cuda
    assert_same_block_mask(gpu.to("cpu"), block_mask(split_lens, attn_modes, sample_lens, device="cpu"))


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("split_lens", "attn_modes", "sample_lens", "message"),
    [
        ([2, 3], ["causal"], [5], "one mode per split"),
        ([2, 3], ["causal", "dense"], [5], r"attn_modes\[1\] is 'dense'"),
        ([2, 3], "causal", [5], "sequence of modes"),
        ([2, 3], ["causal", "full"], [4], "sum to 5 but sample_lens sum to 4"),
        ([2, 3], ["causal", "full"], [3, 2], "inside a split"),
        ([2, -1], ["causal", "full"], [1], "non-negative"),
        ([2.0, 3.0], ["causal", "full"], [5], "integers"),
        (torch.tensor([2.0, 3.0]), ["causal", "full"], [5], "integers"),
        ([[2, 3]], ["causal", "full"], [5], "one-dimensional"),
    ],
)
def test_bad_layouts_are_rejected_with_what_to_fix(split_lens, attn_modes, sample_lens, message):
    for build in (dense_masks, block_mask, mask_predicate):
        with pytest.raises(ValueError, match=message):
            build(split_lens, attn_modes, sample_lens, device="cpu")


def test_bad_dtype_and_block_size_are_rejected():
    for dtype in (torch.int32, torch.float8_e4m3fn, torch.complex64):
        with pytest.raises(ValueError, match="floating dtype that holds -inf"):
            dense_masks([2], ["causal"], [2], device="cpu", dtype=dtype)
    for block_size in (0, -128, 12.5, True):
        with pytest.raises(ValueError, match="block_size"):
            block_mask([2], ["causal"], [2], device="cpu", block_size=block_size)
