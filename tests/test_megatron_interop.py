"""Megatron-Core's IndexedDataset reads what mmidx writes, and mmidx reads what Megatron writes."""

import megatron.core.datasets.indexed_dataset as megatron
import numpy as np
import pytest
import torch
from support.helpers import build, small_dataset

from mmidx.ingest.writer import DatasetBuilder
from mmidx.read.dataset import MMIDXDataset

DTYPES = [(np.uint16, 1000), (np.int32, 152064)]


def random_documents(rng, vocab, count=12):
    """Documents of 1-3 sequences of 0-30 tokens, ids spanning the vocabulary."""
    return [[rng.integers(0, vocab, rng.integers(0, 30)) for _ in range(rng.integers(1, 4))] for _ in range(count)]


def write_with_megatron(prefix, documents, dtype, multimodal=False):
    builder = megatron.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=multimodal)
    modes = []
    for document in documents:
        for k, sequence in enumerate(document):
            builder.add_item(torch.from_numpy(np.asarray(sequence, dtype=np.int64)), mode=k % 3)
            modes.append(k % 3)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return modes


def write_with_mmidx(prefix, documents, vocab):
    with DatasetBuilder(prefix, kind="text", vocab_size=vocab) as builder:
        for document in documents:
            builder.add_document(document)
        builder.finalize()


@pytest.mark.parametrize(("dtype", "vocab"), DTYPES)
def test_megatron_reads_mmidx_text_datasets(tmp_path, dtype, vocab):
    documents = random_documents(np.random.default_rng(0), vocab)
    write_with_mmidx(tmp_path / "ds", documents, vocab)
    theirs = megatron.IndexedDataset(str(tmp_path / "ds"))
    flat = [sequence for document in documents for sequence in document]
    assert theirs.index.dtype == dtype and len(theirs) == len(flat)
    for i, sequence in enumerate(flat):
        assert np.array_equal(theirs[i], sequence)
        assert np.array_equal(theirs.get(i, offset=len(sequence) // 2), sequence[len(sequence) // 2:])
    assert theirs.document_indices.tolist() == np.cumsum([0] + [len(d) for d in documents]).tolist()


@pytest.mark.parametrize(("dtype", "vocab"), DTYPES)
def test_token_files_are_byte_identical_to_megatrons(tmp_path, dtype, vocab):
    documents = random_documents(np.random.default_rng(1), vocab)
    write_with_mmidx(tmp_path / "ours", documents, vocab)
    write_with_megatron(tmp_path / "theirs", documents, dtype)
    for suffix in (".idx", ".bin"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()


def test_megatron_reads_the_token_stream_of_multimodal_datasets(tmp_path):
    samples = small_dataset(tmp_path / "mm", count=5)
    theirs = megatron.IndexedDataset(str(tmp_path / "mm"))
    flat = [text for sample in samples for text in sample.texts]
    assert [theirs[i].tolist() for i in range(len(theirs))] == flat
    assert len(theirs.document_indices) - 1 == len(samples)


@pytest.mark.parametrize(("dtype", "vocab"), DTYPES)
@pytest.mark.parametrize("multimodal", [False, True])
def test_mmidx_reads_megatron_datasets(tmp_path, dtype, vocab, multimodal):
    documents = random_documents(np.random.default_rng(2), vocab)
    modes = write_with_megatron(tmp_path / "m", documents, dtype, multimodal)
    ours = MMIDXDataset(tmp_path / "m")
    theirs = megatron.IndexedDataset(str(tmp_path / "m"), multimodal=multimodal)
    assert ours.kind == "text" and ours.token_dtype == dtype and len(ours) == len(documents)
    assert np.array_equal(ours.tokens.sequence_lengths, theirs.sequence_lengths)
    assert np.array_equal(ours.tokens.sequence_pointers, theirs.index.sequence_pointers)
    assert np.array_equal(ours.tokens.document_indices, theirs.document_indices)
    if multimodal:
        assert ours.tokens.sequence_modes.tolist() == modes
    else:
        assert ours.tokens.sequence_modes is None
    for d, document in enumerate(documents):
        assert [t.tolist() for t in ours[d].texts] == [np.asarray(s).tolist() for s in document]


def test_a_multimodal_dataset_built_twice_is_byte_identical(tmp_path):
    samples = small_dataset(tmp_path / "a", seed=3)
    build(tmp_path / "b", samples)
    for suffix in (".idx", ".bin", ".images", ".plan"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()
