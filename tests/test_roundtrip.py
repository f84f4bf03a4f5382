"""Builder → finalize → reader returns exactly what was appended; merge preserves every sample."""

import os
import pickle
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.helpers import assert_sample_equal, build, raw_samples, small_dataset

from mmidx.ingest.merge import merge_datasets
from mmidx.ingest.writer import DatasetBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources.elements import Element

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(raw_samples(), max_size=8))
def test_random_samples_round_trip(samples):
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp) / "ds", samples, check_images=False)  # the format stores any image bytes as given
        dataset = MMIDXDataset(Path(tmp) / "ds")
        assert len(dataset) == len(samples)
        for i, raw in enumerate(samples):
            assert_sample_equal(dataset[i], raw)
            assert dataset[i].origin == (("input.parquet" if raw.origin[0] >= 0 else None), raw.origin[1])


@SETTINGS
@given(st.lists(st.lists(raw_samples(), max_size=4), min_size=1, max_size=4))
def test_merge_keeps_every_sample_in_order(parts):
    with tempfile.TemporaryDirectory() as tmp:
        prefixes = []
        for k, samples in enumerate(parts):
            build(Path(tmp) / f"part{k}", samples, check_images=False)
            prefixes.append(Path(tmp) / f"part{k}")
        merged = MMIDXDataset(merge_datasets(prefixes, Path(tmp) / "merged"))
        flat = [sample for samples in parts for sample in samples]
        assert len(merged) == len(flat)
        for i, raw in enumerate(flat):
            assert_sample_equal(merged[i], raw)
        assert merged.metadata["counts"]["samples"] == len(flat)


def test_text_dataset_round_trip_with_several_sequences_per_document(tmp_path):
    documents = [[[1, 2, 3]], [[4], [5, 6]], [], [[7, 8, 9, 10]]]
    with DatasetBuilder(tmp_path / "text", kind="text", vocab_size=50000) as builder:
        for document in documents:
            builder.add_document(document)
        builder.finalize()
    dataset = MMIDXDataset(tmp_path / "text")
    assert [[t.tolist() for t in dataset[i].texts] for i in range(len(dataset))] == documents
    assert dataset.tokens.document_indices.tolist() == [0, 1, 3, 3, 4]
    plan = dataset[1].sequence_plan()
    assert [item["type"] for item in plan] == ["text", "text"] and all(item["loss"] == 1 for item in plan)


def test_token_dtype_follows_megatron_rule(tmp_path):
    for vocab, dtype in ((65499, np.uint16), (65500, np.int32), (152000, np.int32)):
        with DatasetBuilder(tmp_path / f"v{vocab}", kind="text", vocab_size=vocab) as builder:
            builder.add_document([[vocab - 1]])
            builder.finalize()
        dataset = MMIDXDataset(tmp_path / f"v{vocab}")
        assert dataset.token_dtype == dtype
        assert dataset.get_tokens(0).tolist() == [vocab - 1]


def test_token_ids_that_do_not_fit_the_dtype_are_refused(tmp_path):
    with DatasetBuilder(tmp_path / "ds", kind="text", vocab_size=1000) as builder:
        with pytest.raises(ValueError, match="do not fit"):
            builder.add_document([[70000]])


def test_payload_outside_the_sample_is_refused(tmp_path):
    with DatasetBuilder(tmp_path / "ds", vocab_size=100) as builder:
        with pytest.raises(ValueError, match="payload"):
            builder.add_sample([[1]], [], [[Element("vae_image", 0)]])


def test_get_tokens_is_bounds_checked_and_zero_copy(tmp_path):
    small_dataset(tmp_path / "ds")
    dataset = MMIDXDataset(tmp_path / "ds")
    first = dataset.get_tokens(0)
    assert not first.flags.writeable and first.base is not None
    assert dataset.get_tokens(0, 1, 2).tolist() == first[1:3].tolist()
    assert dataset.get_tokens(-1).tolist() == dataset.tokens.get(dataset.tokens.sequence_count - 1).tolist()
    for bad in ((dataset.tokens.sequence_count,), (0, len(first) + 1), (0, 0, len(first) + 1), (0, -1), (0, 1, -1)):
        with pytest.raises(IndexError):
            dataset.get_tokens(*bad)
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_gather_equals_reading_each_span(tmp_path):
    small_dataset(tmp_path / "ds", count=6)
    dataset = MMIDXDataset(tmp_path / "ds")
    rng = np.random.default_rng(1)
    sequences = rng.integers(0, dataset.tokens.sequence_count, 50)
    lengths = dataset.tokens.sequence_lengths[sequences]
    offsets = rng.integers(0, lengths + 1)
    takes = rng.integers(0, lengths - offsets + 1)
    tokens, bounds = dataset.gather(sequences, offsets, takes)
    for i, (s, o, n) in enumerate(zip(sequences, offsets, takes, strict=True)):
        assert tokens[bounds[i]:bounds[i + 1]].tolist() == dataset.get_tokens(int(s), int(o), int(n)).tolist()
    _, whole_bounds = dataset.gather(sequences)
    assert np.array_equal(np.diff(whole_bounds), lengths)
    with pytest.raises(IndexError):
        dataset.gather([0], [0], [10**6])


def test_dataset_pickles_as_its_path_and_maps_again_lazily(tmp_path):
    samples = small_dataset(tmp_path / "ds")
    dataset = MMIDXDataset(tmp_path / "ds")
    payload = pickle.dumps(dataset)
    paths = len(os.fsencode(dataset.prefix)) + len(os.fsencode(dataset.cache.folder))
    assert len(payload) < paths + 160  # its path, its cache folder and limit: none of the mapped bytes
    restored = pickle.loads(payload)
    assert restored._mapped is None
    assert_sample_equal(restored[2], samples[2])


def test_dataloader_workers_read_the_same_samples(tmp_path):
    import torch

    small_dataset(tmp_path / "ds", count=8)

    class Texts(torch.utils.data.Dataset):
        def __init__(self, dataset):
            self.dataset = dataset

        def __len__(self):
            return len(self.dataset)

        def __getitem__(self, i):
            return torch.from_numpy(self.dataset[i].text(0).astype(np.int64))

    dataset = Texts(MMIDXDataset(tmp_path / "ds"))
    serial = [dataset[i] for i in range(len(dataset))]
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    assert all(torch.equal(a, b) for a, b in zip(serial, loader, strict=True))


def test_bookkeeping_batches_of_any_size_write_the_same_bytes(tmp_path, monkeypatch):
    """The builder's index arrays are collected in batches; a batch boundary inside a sample changes nothing."""
    from mmidx import format as fmt
    from mmidx.ingest import writer as writer_module

    samples = small_dataset(tmp_path / "default", seed=4, count=9)
    monkeypatch.setattr(writer_module._Growable, "BATCH", 3)
    build(tmp_path / "batched", samples)
    for role in ("idx", "bin", "images", "plan"):
        batched, default = (fmt.file_path(tmp_path / name, role).read_bytes() for name in ("batched", "default"))
        assert batched == default
    for index, raw in enumerate(samples):
        assert_sample_equal(MMIDXDataset(tmp_path / "batched")[index], raw)
