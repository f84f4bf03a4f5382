"""The build tokenizer: BAGEL's special tokens, encodings equal to BAGEL's and Megatron's, identity, pickling."""

import pickle

import numpy as np
import pytest
from support.sources import loaded_tokenizer, qwen_dir, tokenizer_dir, train_tokenizer
from transformers import AutoTokenizer

from mmidx.format import token_dtype_for_vocab
from mmidx.tokenizer import BAGEL_SPECIAL_TOKENS, Tokenizer, TokenizerError

TEXTS = ["A cat sitting on a mat", " leading space", "trailing space ", "", " ", "multi\nline\ttext",
         "ünïcödé 漢字 🙂 emoji", "a<|im_start|>b", "<|vision_start|><|vision_end|>", "x" * 500]


@pytest.fixture(scope="module")
def qwen():
    return Tokenizer(qwen_dir())


def test_missing_bagel_tokens_are_added_like_bagel_add_special_tokens(tmp_path):
    directory = train_tokenizer(tmp_path / "tok", special=["<|endoftext|>"])
    base = len(AutoTokenizer.from_pretrained(directory))
    tokenizer = Tokenizer(directory)
    assert tokenizer.vocab_size == base + 4
    ids = [tokenizer.special_tokens[k] for k in ("bos_token_id", "eos_token_id", "start_of_image", "end_of_image")]
    assert ids == list(range(base, base + 4))
    assert [tokenizer.encode(token) for token in BAGEL_SPECIAL_TOKENS] == [[i] for i in ids]


def test_tokens_already_present_are_not_added_again():
    assert loaded_tokenizer().vocab_size == len(AutoTokenizer.from_pretrained(tokenizer_dir()))


def test_qwen2_special_token_ids_and_megatron_token_dtype(qwen):
    assert qwen.special_tokens == {"bos_token_id": 151644, "eos_token_id": 151645, "start_of_image": 151652,
                                   "end_of_image": 151653, "eod": 151645}
    assert qwen.vocab_size == 151669
    assert token_dtype_for_vocab(qwen.vocab_size) == np.int32


@pytest.mark.parametrize("which", ["bpe", "qwen"])
def test_batch_encoding_equals_encode_and_megatrons_input_ids(which, qwen):
    tokenizer = qwen if which == "qwen" else loaded_tokenizer()
    expected = [tokenizer.hf.encode(text) for text in TEXTS]
    assert tokenizer.encode_batch(TEXTS) == expected
    assert [tokenizer.hf(text).input_ids for text in TEXTS] == expected
    assert [tokenizer.encode(text) for text in TEXTS] == expected


@pytest.mark.parametrize("which", ["bpe", "qwen"])
def test_batch_decoding_equals_decode_on_texts_random_ids_and_special_ids(which, qwen):
    tokenizer = qwen if which == "qwen" else loaded_tokenizer()
    rng = np.random.default_rng(0)
    special = sorted({v for v in tokenizer.special_tokens.values() if v is not None})
    batch = tokenizer.encode_batch(TEXTS) + [rng.integers(0, tokenizer.vocab_size, n).tolist() for n in range(40)]
    batch += [[special[k % len(special)], *ids] for k, ids in enumerate(batch[:20])] + [special, []]
    assert tokenizer.decode_batch(batch) == [tokenizer.hf.decode(ids, clean_up_tokenization_spaces=False)
                                             for ids in batch]
    assert tokenizer.decode_batch(batch[:len(TEXTS)]) == TEXTS


def test_identity_names_path_class_vocabulary_and_checksum(qwen):
    identity = qwen.identity
    assert identity["name_or_path"] == qwen_dir()
    assert identity["class"] == type(qwen.hf).__name__
    assert identity["vocab_size"] == 151669
    assert len(identity["sha256"]) == 64
    assert identity != loaded_tokenizer().identity


def test_pickles_as_its_path_and_reloads_identically():
    tokenizer = loaded_tokenizer()
    data = pickle.dumps(tokenizer)
    assert len(data) < 1000
    again = pickle.loads(data)
    assert again.identity == tokenizer.identity
    assert again.encode_batch(TEXTS) == tokenizer.encode_batch(TEXTS)


def test_reloading_a_tokenizer_that_changed_on_disk_is_refused(tmp_path):
    directory = train_tokenizer(tmp_path / "tok")
    data = pickle.dumps(Tokenizer(directory))
    train_tokenizer(tmp_path / "tok", special=["<|endoftext|>", "<|extra|>"])
    with pytest.raises(TokenizerError, match="changed since the build started"):
        pickle.loads(data)


def test_a_tokenizer_that_cannot_be_found_says_what_to_give(tmp_path):
    with pytest.raises(TokenizerError, match="save_pretrained"):
        Tokenizer(tmp_path / "nowhere")
