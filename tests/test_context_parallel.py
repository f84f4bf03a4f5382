"""Context parallelism's split against the real peer (megatron-core 0.16's ``get_batch_on_this_cp_rank``) and
against a straightforward reference of Transformer Engine's per-document zigzag (``thd_get_partitioned_indices``
needs CUDA): every rank's shard, hand-checked cases, and the shards giving back the pack."""

import itertools

import numpy as np
import pytest
import torch

from mmidx.train.context_parallel import (
    merge_documents,
    padded_lengths,
    padding_multiple,
    split_documents,
    zigzag_documents,
    zigzag_sequence,
)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_per_sequence_zigzag_is_megatrons_on_every_key(cp, monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    length = 2 * cp * 5
    generator = torch.Generator().manual_seed(cp)
    pack = {"tokens": torch.randint(0, 1000, (1, length), generator=generator),
            "labels": torch.randint(-100, 1000, (1, length), generator=generator),
            "loss_mask": torch.rand(1, length, generator=generator),
            "position_ids": torch.arange(length).unsqueeze(0),
            "attention_mask": torch.rand(1, 1, length, length, generator=generator) > 0.5}
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
    for rank in range(cp):
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda rank=rank: rank)
        theirs = get_batch_on_this_cp_rank({key: value.clone() for key, value in pack.items()})
        for key, value in pack.items():
            mine = zigzag_sequence(value, cp, rank, dim=2 if key == "attention_mask" else 1)
            assert torch.equal(mine, theirs[key]), (key, rank)


def reference_partition(cu_seqlens, cp, rank):
    """Transformer Engine's per-document zigzag, one token at a time: of each sub-sequence of length L, the
    tokens of chunks rank and 2cp-1-rank of 2cp chunks of L / 2cp; one rank (no CP) holds every token."""
    if cp == 1:
        return list(range(cu_seqlens[-1]))
    positions = []
    for start, end in itertools.pairwise(cu_seqlens):
        chunk = (end - start) // (2 * cp)
        for which in (rank, 2 * cp - 1 - rank):
            positions += range(start + which * chunk, start + (which + 1) * chunk)
    return positions


def test_the_per_document_zigzag_of_hand_checked_packs():
    assert zigzag_documents([0, 8, 12], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag_documents([0, 8, 12], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert zigzag_documents([0, 4], 1, 0).tolist() == [0, 1, 2, 3]
    assert zigzag_documents([0, 0, 4], 2, 1).tolist() == [1, 2]  # an empty sub-sequence has no tokens


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_the_per_document_zigzag_is_the_reference_and_the_shards_give_back_the_pack(cp):
    rng = np.random.default_rng(cp)
    for _ in range(20):
        lengths = padded_lengths(rng.integers(0, 300, rng.integers(1, 12)), padding_multiple(cp))
        cu = np.concatenate([[0], np.cumsum(lengths)])
        pack = torch.from_numpy(rng.integers(0, 10**6, (1, int(cu[-1]))))
        shards = [split_documents(pack, torch.from_numpy(cu).int(), cp, rank) for rank in range(cp)]
        for rank, shard in enumerate(shards):
            assert zigzag_documents(cu, cp, rank).tolist() == reference_partition(cu.tolist(), cp, rank)
            assert shard.shape[1] == cu[-1] // cp  # every rank holds the same number of tokens
        assert torch.equal(merge_documents(shards, cu), pack)


def test_lengths_that_do_not_split_and_bad_ranks_are_refused():
    with pytest.raises(ValueError, match="does not split into 4 equal chunks"):
        zigzag_documents([0, 8, 14], 2, 0)
    with pytest.raises(ValueError, match="does not split into 4 equal chunks"):
        zigzag_sequence(torch.zeros(1, 10), 2, 0)
    with pytest.raises(ValueError, match="0 <= rank < cp"):
        zigzag_sequence(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="rise from 0"):
        zigzag_documents([4, 8], 2, 0)


def test_the_padding_multiple_is_two_cp_and_cp_tp_under_sequence_parallelism():
    assert padding_multiple(1) == 1 and padding_multiple(2) == 4 and padding_multiple(8) == 16
    assert padding_multiple(2, tp=4, sequence_parallel=True) == 8  # lcm(4, 8)
    assert padding_multiple(4, tp=3, sequence_parallel=True) == 24  # lcm(8, 12)
    assert padding_multiple(1, tp=4, sequence_parallel=True) == 4
    assert padding_multiple(2, tp=4) == 4  # tensor parallelism alone splits no sequence
    assert padded_lengths([0, 1, 4, 5], 4).tolist() == [0, 4, 4, 8]
    with pytest.raises(ValueError):
        padding_multiple(0)
