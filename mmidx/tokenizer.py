"""The tokenizer a dataset is built with: any Hugging Face tokenizer, plus BAGEL's four special tokens.

BAGEL (``data/data_utils.py``, ``add_special_tokens``) adds ``<|im_start|>``, ``<|im_end|>``,
``<|vision_start|>`` and ``<|vision_end|>`` with ``tokenizer.add_tokens`` when they are not among
the tokenizer's special tokens, and frames every text as ``<|im_start|>`` + ids + ``<|im_end|>``.
:class:`Tokenizer` does the same, so token ids (and the vocabulary size, which picks the token dtype
as Megatron does) equal the trainer's. Text is encoded exactly as BAGEL (``tokenizer.encode(text)``)
and Megatron's ``preprocess_data.py`` (``tokenizer(text).input_ids``) encode it; batches go through
the Rust backend's ``encode_batch_fast``, checked at load time to give the same ids.

A :class:`Tokenizer` pickles as its name or path and the sha256 of its serialized form: a worker
process loads it again and refuses a tokenizer that changed on disk in between.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from typing import Any

from mmidx.errors import MMIDXError

BAGEL_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")

# Strings whose encodings must agree between the batch path and ``tokenizer.encode``.
_AGREEMENT_PROBES = ("", " ", "Hello world", "  two  spaces\n\ttab", "ünïcödé 漢字 🙂", "a<|im_start|>b<|im_end|>",
                     "<|vision_start|><|vision_end|>", "1234567890 3.14")


class TokenizerError(MMIDXError, ValueError):
    """The tokenizer cannot be loaded or does not behave as a dataset build needs."""


class Tokenizer:
    """A loaded Hugging Face tokenizer with BAGEL's special tokens, as the builders use it.

    ``name_or_path`` is a local directory (``save_pretrained`` output) or a model name already in
    the local Hugging Face cache; nothing is downloaded (set ``HF_HUB_OFFLINE=1``).
    """

    def __init__(self, name_or_path: str | os.PathLike):
        from transformers import AutoTokenizer

        self.name_or_path = os.fspath(name_or_path)
        try:
            self.hf = AutoTokenizer.from_pretrained(self.name_or_path)
        except (OSError, ValueError) as error:
            raise TokenizerError(f"cannot load a tokenizer from {self.name_or_path!r}: {error}. Give a local "
                                 "directory written by save_pretrained, or a name in the local Hugging Face "
                                 "cache (downloads are off)") from error
        special = set()
        for value in self.hf.special_tokens_map.values():
            special.update([value] if isinstance(value, str) else value)
        self.hf.add_tokens([token for token in BAGEL_SPECIAL_TOKENS if token not in special])
        backend = getattr(self.hf, "backend_tokenizer", None)
        self._backend = backend if backend is not None and self._backend_agrees(backend) else None
        self.sha256 = self._serialized_sha256()

    def _backend_agrees(self, backend: Any) -> bool:
        ids = [encoding.ids for encoding in backend.encode_batch_fast(list(_AGREEMENT_PROBES))]
        return ids == [self.hf.encode(text) for text in _AGREEMENT_PROBES]

    def _serialized_sha256(self) -> str:
        if self._backend is not None:
            return hashlib.sha256(self._backend.to_str().encode()).hexdigest()
        vocab = sorted(self.hf.get_vocab().items(), key=lambda item: item[1])
        return hashlib.sha256(repr((type(self.hf).__name__, vocab)).encode()).hexdigest()

    def __reduce__(self) -> tuple[Any, ...]:
        return _reload, (self.name_or_path, self.sha256)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: what BAGEL's ``tokenizer.encode(text)`` returns."""
        return self.hf.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of every text, equal to ``[encode(t) for t in texts]`` and several times faster."""
        if not texts:
            return []
        if self._backend is None:
            return self.hf(list(texts)).input_ids
        return [encoding.ids for encoding in self._backend.encode_batch_fast(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (special tokens spelled out), for people reading a dataset."""
        return self.hf.decode(list(ids), clean_up_tokenization_spaces=False)

    def _id(self, token: str) -> int:
        return self.hf.convert_tokens_to_ids(token)

    @property
    def eod(self) -> int | None:
        """End-of-document id: the tokenizer's eos token, as Megatron's Hugging Face tokenizer uses it."""
        return self.hf.eos_token_id

    @property
    def special_tokens(self) -> dict[str, int | None]:
        """BAGEL's ``new_token_ids`` (bos/eos = im_start/im_end, start/end of image) and ``eod``."""
        return {"bos_token_id": self._id("<|im_start|>"), "eos_token_id": self._id("<|im_end|>"),
                "start_of_image": self._id("<|vision_start|>"), "end_of_image": self._id("<|vision_end|>"),
                "eod": self.eod}

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (``len(tokenizer)``), which decides the token dtype."""
        return len(self.hf)

    @property
    def identity(self) -> dict[str, Any]:
        """What dataset metadata records about the tokenizer, to tell tokenizers apart later."""
        return {"name_or_path": self.name_or_path, "class": type(self.hf).__name__,
                "vocab_size": self.vocab_size, "sha256": self.sha256}


def _reload(name_or_path: str, sha256: str) -> Tokenizer:
    tokenizer = Tokenizer(name_or_path)
    if tokenizer.sha256 != sha256:
        raise TokenizerError(f"the tokenizer at {name_or_path!r} changed since the build started "
                             f"(sha256 {tokenizer.sha256[:12]}, was {sha256[:12]}); restart the build")
    return tokenizer


@functools.lru_cache(maxsize=8)
def _loaded(name_or_path: str) -> Tokenizer:
    return Tokenizer(name_or_path)


def recorded_tokenizer(identity: dict[str, Any] | None, where: str) -> Tokenizer:
    """The tokenizer a dataset's metadata records (``identity``), loaded once per process, refused (a
    TokenizerError naming ``where``) unless it loads and is the very one the dataset was built with."""
    if not identity:
        raise TokenizerError(f"{where}: the dataset records no tokenizer, so its texts cannot be decoded; "
                             "build it with --tokenizer")
    try:
        tokenizer = _loaded(identity["name_or_path"])
    except (TokenizerError, OSError, ValueError) as error:
        raise TokenizerError(f"{where}: its tokenizer {identity['name_or_path']!r} does not load "
                             f"({str(error).splitlines()[0][:120]})") from error
    if tokenizer.sha256 != identity.get("sha256"):
        raise TokenizerError(f"{where}: the tokenizer at {identity['name_or_path']!r} is not the one the dataset "
                             "was built with")
    return tokenizer
