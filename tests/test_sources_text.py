"""text: Megatron's preprocess_data.py --append-eod tokens, byte for byte, in files Megatron reads unchanged."""

import numpy as np
import pytest
import torch
from support.sources import build, qwen_dir, write_jsonl

from mmidx.format import file_path

DOCUMENTS = ["The quick brown fox jumps over the lazy dog.", " leading and trailing spaces ",
             "multi\nline\n\ntext with\ttabs", "ünïcödé 漢字 and emoji 🙂", "a<|im_start|>literal special",
             "short", "x" * 3000]


@pytest.fixture(scope="module")
def qwen_hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir())


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    path = write_jsonl(folder / "docs.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCUMENTS)])
    dataset, report = build("text", [path], folder / "out", tokenizer=qwen_dir())
    return dataset, report, folder, path


def _megatron_preprocess(hf, documents, prefix):
    """What Megatron-LM's preprocess_data.py --append-eod writes with a Hugging Face tokenizer."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(len(hf)))
    for document in documents:
        builder.add_item(torch.IntTensor([*hf(document).input_ids, hf.eos_token_id]))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def test_megatron_indexed_dataset_reads_the_tokenizers_tokens_plus_eod(text, qwen_hf):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    _dataset, _, folder, _ = text
    megatron = IndexedDataset(str(folder / "out"))
    assert len(megatron) == len(DOCUMENTS)
    for i, document in enumerate(DOCUMENTS):
        assert megatron[i].tolist() == [*qwen_hf(document).input_ids, 151645]
    assert megatron.document_indices.tolist() == list(range(len(DOCUMENTS) + 1))


def test_token_files_are_byte_identical_to_megatron_preprocess_data(text, qwen_hf):
    _, _, folder, _ = text
    _megatron_preprocess(qwen_hf, DOCUMENTS, folder / "megatron")
    for role in ("bin", "idx"):
        assert file_path(folder / "out", role).read_bytes() == file_path(folder / "megatron", role).read_bytes()


def test_the_dataset_is_a_text_kind_dataset_with_one_sequence_per_document(text):
    dataset = text[0]
    assert dataset.kind == "text" and dataset.token_dtype == np.int32
    assert [dataset[i].num_texts for i in range(len(dataset))] == [1] * len(DOCUMENTS)


def test_cutting_a_file_into_byte_ranges_builds_the_same_dataset(text, tmp_path):
    path = text[3]
    whole, _ = build("text", [path], tmp_path / "whole")
    cut, report = build("text", [path], tmp_path / "cut", bytes_per_shard=100)
    assert report.data["units"] >= 3
    for role in ("bin", "idx"):
        assert file_path(cut.prefix, role).read_bytes() == file_path(whole.prefix, role).read_bytes()


def test_a_file_uri_input_gives_the_same_tokens(text, tmp_path):
    path = text[3]
    whole, _ = build("text", [path], tmp_path / "whole")
    via_uri, _ = build("text", [f"file://{path}"], tmp_path / "uri")
    assert file_path(via_uri.prefix, "bin").read_bytes() == file_path(whole.prefix, "bin").read_bytes()


def test_text_key_names_the_field(tmp_path):
    from support.sources import loaded_tokenizer

    path = write_jsonl(tmp_path / "d.jsonl", [{"content": "hello there", "text": "not this"}])
    dataset, _ = build("text", [path], tmp_path / "out", text_key="content")
    tokenizer = loaded_tokenizer()
    assert dataset[0].text(0).tolist() == [*tokenizer.hf("hello there").input_ids, tokenizer.eod]
