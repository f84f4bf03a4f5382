"""GPT text samples equal Megatron-Core's GPTDataset samples for the same data and config."""

import megatron.core.datasets.gpt_dataset as gpt_dataset
import numpy as np
import pytest
import torch

from mmidx.ingest.writer import DatasetBuilder
from mmidx.train.gpt import GPTTextDataset


class Tokenizer:
    """What GPTDatasetConfig reads from a tokenizer (no pad token: Megatron then pads with -1)."""

    vocab_size = 1000
    eod = 0
    def __init__(self):
        self.unique_identifiers = {"class": "test"}
        self.special_tokens = {}


def megatron_dataset(prefix, tmp_path, seq_length, num_samples, seed, add_extra, reset=False, eod_mask=False):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    config = gpt_dataset.GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=None, split="1,0,0", tokenizer=Tokenizer(),
        reset_position_ids=reset, reset_attention_mask=False, eod_mask_loss=eod_mask,
        add_extra_token_to_sequence=add_extra, path_to_cache=str(tmp_path / f"cache-{seed}-{add_extra}-{reset}"))
    indexed = IndexedDataset(str(prefix))
    return gpt_dataset.GPTDataset(indexed, str(prefix), np.arange(len(indexed.sequence_lengths), dtype=np.int32),
                                  num_samples, Split.train, config)


@pytest.fixture(scope="module")
def text_prefix(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("gpt") / "text"
    rng = np.random.default_rng(0)
    with DatasetBuilder(prefix, kind="text", vocab_size=1000, special_tokens={"eod": 0}) as builder:
        for _ in range(40):
            builder.add_document([np.append(rng.integers(1, 1000, rng.integers(1, 60)), 0)])
        builder.finalize()
    return prefix


@pytest.mark.parametrize(("num_samples", "add_extra", "seed"), [(None, True, 1), (100, True, 7), (75, False, 3)])
def test_samples_equal_megatrons(text_prefix, tmp_path, num_samples, add_extra, seed):
    ours = GPTTextDataset(text_prefix, seq_length=32, num_samples=num_samples, seed=seed, add_extra_token=add_extra)
    theirs = megatron_dataset(text_prefix, tmp_path, 32, num_samples, seed, add_extra)
    assert len(ours) == len(theirs)
    for i in range(len(ours)):
        mine, reference = ours[i], theirs[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(mine[key], reference[key]), (i, key)


def test_reset_position_ids_and_eod_mask_loss_equal_megatrons(text_prefix, tmp_path):
    ours = GPTTextDataset(text_prefix, seq_length=48, num_samples=30, seed=2, reset_position_ids=True,
                          eod_mask_loss=True)
    theirs = megatron_dataset(text_prefix, tmp_path, 48, 30, 2, True, reset=True, eod_mask=True)
    for i in range(len(ours)):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(ours[i][key], theirs[i][key]), (i, key)


def test_cu_seqlens_mark_where_documents_start(text_prefix):
    ours = GPTTextDataset(text_prefix, seq_length=64, seed=5)
    for i in range(len(ours)):
        sample = ours[i]
        cu = sample["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == 64 and cu == sorted(set(cu))
        eods = (torch.nonzero(sample["tokens"] == 0).flatten() + 1).tolist()
        assert [p for p in eods if p < 64] == cu[1:-1]


def test_the_index_configuration_is_validated(text_prefix):
    for bad in ({"seq_length": 1}, {"seq_length": 8, "num_samples": 0}, {"seq_length": 8, "seed": -1}):
        with pytest.raises(ValueError):
            GPTTextDataset(text_prefix, **bad)


def test_indices_are_cached_by_configuration(text_prefix, tmp_path):
    first = GPTTextDataset(text_prefix, seq_length=16, seed=3, cache_dir=tmp_path)
    again = GPTTextDataset(text_prefix, seq_length=16, seed=3, cache_dir=tmp_path)
    assert isinstance(again.sample_index, np.memmap) and np.array_equal(first.sample_index, again.sample_index)
    GPTTextDataset(text_prefix, seq_length=16, seed=3, add_extra_token=False, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2  # add_extra_token is part of the key (Megatron's key omits it)


def test_a_rewritten_megatron_pair_gets_new_indices_not_stale_cached_ones(tmp_path):
    """A bare Megatron pair has no checksum of its own; the cache must still see that it changed."""
    import os

    import megatron.core.datasets.indexed_dataset as indexed

    def write(documents, mtime):
        builder = indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
        for document in documents:
            builder.add_item(torch.tensor(document))
            builder.end_document()
        builder.finalize(str(tmp_path / "m.idx"))
        for suffix in (".idx", ".bin"):
            os.utime(tmp_path / f"m{suffix}", ns=(mtime, mtime))

    write([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]] * 4, 10**18)
    first = GPTTextDataset(tmp_path / "m", seq_length=4, seed=1, cache_dir=tmp_path / "cache")
    write([[9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4]] * 4, 2 * 10**18)  # as many sequences, longer
    second = GPTTextDataset(tmp_path / "m", seq_length=4, seed=1, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 2
    assert len(first) == (4 * 10 - 1) // 4 and len(second) == (4 * 14 - 1) // 4
