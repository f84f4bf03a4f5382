"""The tokenizer cache: a second load of a local tokenizer takes the backend transformers set up from the
cache, without importing transformers, and behaves exactly as the first; any change of the files is a miss."""

import json
import os
import subprocess
import sys

import pytest
from support.sources import qwen_dir, train_tokenizer
from transformers import AutoTokenizer

from mmidx.tokenizer import Tokenizer, TokenizerError

TEXTS = ["A cat sitting on a mat", " leading space", "", "ünïcödé 漢字 🙂", "a<|im_start|>b<|im_end|>",
         "<|vision_start|><|vision_end|>", "x" * 300]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MMIDX_CACHE_DIR", str(folder))
    return folder / "tokenizers"


def _facts(tokenizer):
    return (tokenizer.identity, tokenizer.special_tokens, tokenizer.eod, tokenizer.vocab_size,
            tokenizer.encode_batch(TEXTS))


@pytest.mark.parametrize("which", ["bpe", "qwen"])
def test_a_cached_load_equals_a_fresh_one_and_transformers_own_encodings(which, cache, tmp_path):
    directory = qwen_dir() if which == "qwen" else train_tokenizer(tmp_path / "tok")
    fresh = Tokenizer(directory)
    assert len(list(cache.iterdir())) == 1
    cached = Tokenizer(directory)
    assert cached._hf is None  # transformers not used
    assert _facts(cached) == _facts(fresh)
    hf = AutoTokenizer.from_pretrained(directory)
    hf.add_tokens([t for t in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
                   if t not in hf.get_vocab()])
    assert cached.encode_batch(TEXTS) == [hf.encode(text) for text in TEXTS]
    assert cached.vocab_size == len(hf) and cached.eod == hf.eos_token_id
    assert [cached.encode(text) for text in TEXTS] == [hf.encode(text) for text in TEXTS]  # loads hf lazily
    ids = cached.encode_batch(TEXTS)[0]
    assert cached.decode(ids) == fresh.decode(ids) == "A cat sitting on a mat"


def test_a_second_process_loads_the_tokenizer_without_importing_transformers(cache, tmp_path):
    directory = train_tokenizer(tmp_path / "tok")
    script = (f"import json, sys\nfrom mmidx.tokenizer import Tokenizer\nt = Tokenizer({directory!r})\n"
              f"print(json.dumps([t.identity, t.special_tokens, t.encode_batch({TEXTS!r}),"
              " 'transformers' in sys.modules]))")
    env = {**os.environ, "MMIDX_CACHE_DIR": str(cache.parent)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                      check=True).stdout) for _ in range(2)]
    assert runs[0][-1] is True and runs[1][-1] is False
    assert runs[0][:-1] == runs[1][:-1]


def test_a_changed_tokenizer_file_misses_the_cache(cache, tmp_path):
    directory = train_tokenizer(tmp_path / "tok")
    before = Tokenizer(directory)
    train_tokenizer(tmp_path / "tok", special=["<|endoftext|>", "<|extra|>"])
    after = Tokenizer(directory)
    assert after.sha256 != before.sha256
    assert after.vocab_size == len(AutoTokenizer.from_pretrained(directory)) + 4
    assert len(list(cache.iterdir())) == 2


def test_a_tokenizer_changed_after_a_cached_load_is_refused_when_transformers_is_needed(cache, tmp_path):
    directory = train_tokenizer(tmp_path / "tok")
    Tokenizer(directory)
    cached = Tokenizer(directory)
    train_tokenizer(tmp_path / "tok", special=["<|endoftext|>", "<|extra|>"])
    with pytest.raises(TokenizerError, match="changed since it was loaded"):
        cached.decode([1, 2])


def test_a_corrupt_cache_entry_is_ignored_and_rewritten(cache, tmp_path):
    directory = train_tokenizer(tmp_path / "tok")
    fresh = Tokenizer(directory)
    (entry,) = cache.iterdir()
    entry.write_text("{not json")
    again = Tokenizer(directory)
    assert again._hf is not None and _facts(again) == _facts(fresh)
    assert json.loads(entry.read_text())["sha256"] == fresh.sha256


def test_a_cache_entry_whose_backend_does_not_match_its_checksum_is_loaded_afresh(cache, tmp_path):
    directory = train_tokenizer(tmp_path / "tok")
    fresh = Tokenizer(directory)
    (entry,) = cache.iterdir()
    facts = json.loads(entry.read_text())
    other = Tokenizer(train_tokenizer(tmp_path / "other", special=("<|other|>",)))  # valid, but not this one
    assert other.sha256 != fresh.sha256
    facts["backend"] = other._backend.to_str()
    entry.write_text(json.dumps(facts))
    again = Tokenizer(directory)
    assert again._hf is not None and _facts(again) == _facts(fresh)


def test_a_cache_that_cannot_be_written_only_costs_time(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MMIDX_CACHE_DIR", str(tmp_path / "file"))
    directory = train_tokenizer(tmp_path / "tok")
    assert _facts(Tokenizer(directory)) == _facts(Tokenizer(directory))
