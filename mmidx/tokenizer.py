"""The tokenizer a dataset is built with: any Hugging Face tokenizer, plus BAGEL's four special tokens.

BAGEL (``data/data_utils.py``, ``add_special_tokens``) adds ``<|im_start|>``, ``<|im_end|>``,
``<|vision_start|>`` and ``<|vision_end|>`` with ``tokenizer.add_tokens`` when they are not among
the tokenizer's special tokens, and frames every text as ``<|im_start|>`` + ids + ``<|im_end|>``.
:class:`Tokenizer` does the same, so token ids (and the vocabulary size, which picks the token dtype
as Megatron does) equal the trainer's. Text is encoded exactly as BAGEL (``tokenizer.encode(text)``)
and Megatron's ``preprocess_data.py`` (``tokenizer(text).input_ids``) encode it; batches go through
the Rust backend's ``encode_batch_fast``, checked at load time to give the same ids.

A build may add special tokens of its own (``added_tokens``: a chat config's bos/eos, e.g. ``<s>``). A string
the tokenizer already encodes as one id keeps that id; any other is registered as Hugging Face's
``add_tokens(..., special_tokens=True)`` registers it: matched whole in text from then on, with its id in the
vocabulary if the vocabulary holds the string (Qwen2's ``<s>``, which its text encoding splits), else a new id
after BAGEL's four. The dataset's metadata records each string and its id in the tokenizer's identity
(``added_tokens``), so every later reader loads the same vocabulary (the model's embeddings must cover
``vocab_size``).

A :class:`Tokenizer` pickles as its name or path, its added tokens and the sha256 of its serialized form: a
worker process loads it again and refuses a tokenizer that changed on disk in between.

A tokenizer is named by a folder (``save_pretrained`` output), a ``tokenizer.json`` file (the tokenizers
library's), a model id in the local Hugging Face cache, or an org/name id of the hub, downloaded unless
``HF_HUB_OFFLINE`` is set. Which one is decided before ``transformers`` is imported: a name that is none of these
fails at once, in one line saying where it looked on disk and whether the hub was asked (once, for an org/name id
only, within ``HUB_TIMEOUT`` seconds), instead of after a minute of ``transformers``' retries.

Loading through ``transformers`` costs about 4 CPU-seconds per process (it imports torch), more than a
whole small build's work. So the first load of a local tokenizer directory or file records what the build needs
(the Rust backend as ``transformers`` set it up, once it agreed with ``tokenizer.encode``; the class
name, vocabulary size, special ids and checksum) in ``$MMIDX_CACHE_DIR/tokenizers`` (default
``~/.cache/mmidx``), keyed by the name, size, time and content of every file of the directory (or the file) and the
versions of ``transformers`` and ``tokenizers``; a later load with the same key takes the backend from
there (0.5 CPU-s) and loads ``transformers`` only if ``hf``, ``encode`` or ``decode`` is used.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmidx.errors import MMIDXError, option
from mmidx.io.storage import cache_root

BAGEL_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")

# Strings whose encodings must agree between the batch path and ``tokenizer.encode``.
_AGREEMENT_PROBES = ("", " ", "Hello world", "  two  spaces\n\ttab", "ünïcödé 漢字 🙂", "a<|im_start|>b<|im_end|>",
                     "<|vision_start|><|vision_end|>", "1234567890 3.14")
_CACHE_FORMAT = 1
_HASHED_FILE_BYTES = 64 << 20  # files up to this size are keyed by content, larger ones (weights) by size and time
# The files a tokenizer folder written by save_pretrained holds at least one of: the fast tokenizer, the config, or
# the vocabulary of a BPE (GPT-2, Qwen), WordPiece (BERT) or SentencePiece (Llama, T5, XLM-R) tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


class TokenizerError(MMIDXError, ValueError):
    """The tokenizer cannot be loaded or does not behave as a dataset build needs."""


class Tokenizer:
    """A loaded Hugging Face tokenizer with BAGEL's special tokens, as the builders use it.

    ``name_or_path`` is a local directory (``save_pretrained`` output), a ``tokenizer.json`` file (the tokenizers
    library's), a model id in the local Hugging Face cache, or an org/name id of the hub, downloaded unless
    ``HF_HUB_OFFLINE`` is set; a name that is none of these fails at once, saying where it looked (see the
    module's docstring). ``added_tokens`` are special tokens the dataset adds (see the module's docstring); each
    must come out of the tokenizer as one id, or loading fails saying which would be split.
    """

    def __init__(self, name_or_path: str | os.PathLike, added_tokens: Sequence[str] = ()):
        self.name_or_path = os.fspath(name_or_path)
        self.added_tokens = tuple(added_tokens)
        self._hf: Any = None
        _check_folder(self.name_or_path)  # before the cache key, which would hash every file of a wrong folder
        key = _cache_key(self.name_or_path, self.added_tokens)
        cached = _read_cache(key)
        if cached is not None:
            from tokenizers import Tokenizer as Backend

            self._backend = Backend.from_str(cached.pop("backend"))
            self._facts = cached
            return
        hf = _load_hf(self.name_or_path, self.added_tokens)
        backend = getattr(hf, "backend_tokenizer", None)
        self._backend = backend if backend is not None and _backend_agrees(hf, backend) else None
        self._hf = hf
        self._facts = {"class": type(hf).__name__, "vocab_size": len(hf), "eod": hf.eos_token_id,
                       "sha256": _serialized_sha256(hf, self._backend),
                       "ids": {**{token: hf.convert_tokens_to_ids(token) for token in BAGEL_SPECIAL_TOKENS},
                               **{token: _ids(hf, token)[0] for token in self.added_tokens}}}
        if self._backend is not None:
            _write_cache(key, {**self._facts, "backend": self._backend.to_str()})

    @property
    def hf(self) -> Any:
        """The ``transformers`` tokenizer (loaded on first use when the backend came from the cache)."""
        if self._hf is None:
            hf = _load_hf(self.name_or_path, self.added_tokens)
            if _serialized_sha256(hf, getattr(hf, "backend_tokenizer", None)) != self.sha256:
                raise TokenizerError(f"the tokenizer at {self.name_or_path!r} changed since it was loaded; "
                                     "load it again")
            self._hf = hf
        return self._hf

    @property
    def sha256(self) -> str:
        """The sha256 of the tokenizer's serialized form (its backend, or its class and vocabulary)."""
        return self._facts["sha256"]

    def __reduce__(self) -> tuple[Any, ...]:
        return _reload, (self.name_or_path, self.sha256, self.added_tokens)

    def token_id(self, token: str) -> int:
        """The single id of ``token``, one of BAGEL's special tokens or of ``added_tokens``."""
        return self._facts["ids"][token]

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

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """The texts of many id lists, equal to ``[decode(ids) for ids in batch]`` and several times faster."""
        if self._backend is None:
            return [self.decode(ids) for ids in batch]
        return self._backend.decode_batch(batch, skip_special_tokens=False)

    @property
    def eod(self) -> int | None:
        """End-of-document id: the tokenizer's eos token, as Megatron's Hugging Face tokenizer uses it."""
        return self._facts["eod"]

    @property
    def special_tokens(self) -> dict[str, int | None]:
        """BAGEL's ``new_token_ids`` (bos/eos = im_start/im_end, start/end of image) and ``eod``."""
        ids = self._facts["ids"]
        return {"bos_token_id": ids["<|im_start|>"], "eos_token_id": ids["<|im_end|>"],
                "start_of_image": ids["<|vision_start|>"], "end_of_image": ids["<|vision_end|>"], "eod": self.eod}

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (``len(tokenizer)``), which decides the token dtype."""
        return self._facts["vocab_size"]

    @property
    def identity(self) -> dict[str, Any]:
        """What dataset metadata records about the tokenizer, to tell tokenizers apart later."""
        identity = {"name_or_path": self.name_or_path, "class": self._facts["class"],
                    "vocab_size": self.vocab_size, "sha256": self.sha256}
        if not self.added_tokens:
            return identity
        return {**identity, "added_tokens": {token: self.token_id(token) for token in self.added_tokens}}


_REPO_ID = re.compile(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?")
HUB_TIMEOUT = 3.0  # seconds the hub is given to say whether an org/name id exists (no retries)


def _what_to_give() -> str:
    """The end of every message about a tokenizer not found: what one is, and the one way to keep Qwen2's."""
    return (f"{option('tokenizer')} is a folder written by save_pretrained, a tokenizer.json file, or a Hugging Face "
            "org/name id, cached or online (to keep one: AutoTokenizer.from_pretrained('Qwen/Qwen2-7B')"
            ".save_pretrained('Qwen2-7B'))")


def _names_a_path(name: str) -> bool:
    """Whether a tokenizer name can only be a path: not a Hugging Face repo id (``Qwen/Qwen2-7B``), as a
    trailing slash, a leading ``/``, ``.`` or ``~``, or more than one ``/`` show."""
    return name.endswith(("/", os.sep)) or name.startswith(("/", ".", "~")) or _REPO_ID.fullmatch(name) is None


def _check_folder(name_or_path: str) -> None:
    """Refuse a folder that holds none of :data:`TOKENIZER_FILES` (a folder of images, a model without its
    tokenizer) in one line naming them, rather than in what transformers says when it tries every class."""
    if os.path.isdir(name_or_path) and not any(os.path.isfile(os.path.join(name_or_path, name))
                                               for name in TOKENIZER_FILES):
        raise TokenizerError(f"{name_or_path}: holds no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}); "
                             f"{option('tokenizer')} is a folder written by save_pretrained, e.g. "
                             "AutoTokenizer.from_pretrained(NAME).save_pretrained(FOLDER)")


def _locate(name_or_path: str) -> tuple[str, str]:
    """Where the tokenizer ``name_or_path`` loads from: ``("folder", path)``, ``("file", path)`` (a tokenizers JSON
    file), ``("cache", snapshot folder)`` (a model id in the local Hugging Face cache, loaded from the folder of its
    cached files, so no file the hub never sent is looked for) or ``("hub", id)`` (an org/name id the hub holds).

    Decided before ``transformers`` is imported, so that a name that resolves nowhere fails at once in one
    TokenizerError saying where it looked, instead of ``transformers`` retrying the hub for a minute. The hub is
    asked only for an org/name id, once, with a :data:`HUB_TIMEOUT`, and never when ``HF_HUB_OFFLINE`` is set.
    """
    if os.path.isdir(name_or_path):
        return "folder", name_or_path
    if os.path.isfile(name_or_path):
        return "file", name_or_path
    looked = f"{name_or_path}: no folder or file {os.path.abspath(os.path.expanduser(name_or_path))}"
    if _names_a_path(name_or_path):
        raise TokenizerError(f"{looked}; {_what_to_give()}")
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = [try_to_load_from_cache(name_or_path, file) for file in ("tokenizer_config.json", "tokenizer.json")]
    except HFValidationError:  # not a repo id after all (Hugging Face's rules are stricter than _REPO_ID's)
        raise TokenizerError(f"{looked}; {_what_to_give()}") from None
    for path in cached:
        if isinstance(path, str):
            return "cache", os.path.dirname(path)
    looked += f", no model {name_or_path} in the Hugging Face cache {constants.HF_HUB_CACHE}"
    if constants.HF_HUB_OFFLINE:
        raise TokenizerError(f"{looked}, and the hub was not asked (HF_HUB_OFFLINE is set); {_what_to_give()}")
    if "/" not in name_or_path:
        raise TokenizerError(f"{looked}, and the hub was not asked (it is asked for an org/name id only); "
                             f"{_what_to_give()}")
    answer = _ask_hub(name_or_path)
    if answer:
        raise TokenizerError(f"{looked}, and the hub ({constants.ENDPOINT}) {answer}; {_what_to_give()}")
    return "hub", name_or_path


def _ask_hub(repo_id: str) -> str | None:
    """None if the hub holds the model ``repo_id`` (gated ones too: loading then says what access it needs), else
    what it answered, in words. One request, given :data:`HUB_TIMEOUT` seconds in all (name resolution included,
    which no socket timeout bounds: the request runs in a daemon thread that is abandoned when late)."""
    answers: list[str | None] = []
    asking = threading.Thread(target=lambda: answers.append(_hub_answer(repo_id)), daemon=True)
    asking.start()
    asking.join(HUB_TIMEOUT)
    return answers[0] if answers else f"did not answer within {HUB_TIMEOUT:g} s"


def _hub_answer(repo_id: str) -> str | None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(repo_id, timeout=HUB_TIMEOUT)
    except GatedRepoError:
        return None
    except RepositoryNotFoundError:
        return f"has no model {repo_id} that this machine may read"
    except Exception as error:  # httpx's timeouts and connection errors, an HTTP error status, a proxy's reply
        why = " ".join(str(error).split())[:160] or type(error).__name__
        return f"did not answer ({why})"
    return None


def _load_hf(name_or_path: str, added_tokens: Sequence[str] = ()) -> Any:
    """``AutoTokenizer.from_pretrained`` (or a tokenizer.json file) with BAGEL's special tokens added as BAGEL adds
    them, then ``added_tokens`` (those not in the vocabulary yet) as special tokens, each checked to encode as one
    id."""
    where, path = _locate(name_or_path)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # the tokenizers library's parse errors are bare Exceptions; transformers' are OSError or ValueError
    unreadable = Exception if where == "file" else (OSError, ValueError)
    try:
        if where == "file":
            hf = PreTrainedTokenizerFast(tokenizer_file=path)
        else:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=where != "hub")
    except unreadable as error:
        why = " ".join(str(error).split())[:300] or type(error).__name__  # one line, however many they wrote
        raise TokenizerError(f"cannot load a tokenizer from the {where} {name_or_path!r}: {why}; {_what_to_give()}") \
            from error
    special = set()
    for value in hf.special_tokens_map.values():
        special.update([value] if isinstance(value, str) else value)
    hf.add_tokens([token for token in BAGEL_SPECIAL_TOKENS if token not in special])
    hf.add_tokens([token for token in dict.fromkeys(added_tokens) if len(_ids(hf, token)) != 1],
                  special_tokens=True)
    for token in added_tokens:
        if len(ids := _ids(hf, token)) != 1:
            raise TokenizerError(f"the tokenizer {name_or_path!r} splits the special token {token!r} into "
                                 f"{len(ids)} ids {ids[:8]} even as an added token; choose another string")
    return hf


def _ids(hf: Any, text: str) -> list[int]:
    """The ids of ``text`` alone (no bos/eos of the tokenizer's own)."""
    return hf.encode(text, add_special_tokens=False)


def _backend_agrees(hf: Any, backend: Any) -> bool:
    ids = [encoding.ids for encoding in backend.encode_batch_fast(list(_AGREEMENT_PROBES))]
    return ids == [hf.encode(text) for text in _AGREEMENT_PROBES]


def _serialized_sha256(hf: Any, backend: Any) -> str:
    if backend is not None:
        return hashlib.sha256(backend.to_str().encode()).hexdigest()
    vocab = sorted(hf.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(repr((type(hf).__name__, vocab)).encode()).hexdigest()


def _cache_key(name_or_path: str, added_tokens: Sequence[str] = ()) -> str | None:
    """The cache key of a local tokenizer directory or tokenizer.json file (None for anything else): its files,
    the tokens added to it and the versions."""
    folder = Path(name_or_path)
    if not (folder.is_dir() or folder.is_file()):
        return None
    digest = hashlib.sha256(repr((_CACHE_FORMAT, BAGEL_SPECIAL_TOKENS, tuple(added_tokens), _AGREEMENT_PROBES,
                                  importlib.metadata.version("transformers"),
                                  importlib.metadata.version("tokenizers"))).encode())
    try:
        for path in [folder] if folder.is_file() else sorted(folder.iterdir()):
            if path.is_file():
                stat = path.stat()
                digest.update(repr((path.name, stat.st_size, stat.st_mtime_ns)).encode())
                if stat.st_size <= _HASHED_FILE_BYTES:
                    digest.update(hashlib.sha256(path.read_bytes()).digest())
    except OSError:
        return None
    return digest.hexdigest()


def _cache_path(key: str) -> Path:
    return cache_root().parent / "tokenizers" / f"{key}.json"


def _read_cache(key: str | None) -> dict[str, Any] | None:
    """The cached facts and backend of ``key``; None when absent or unreadable (then it is loaded afresh)."""
    if key is None:
        return None
    try:
        cached = json.loads(_cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(cached, dict) and cached.get("format") == _CACHE_FORMAT
            and isinstance(cached.get("backend"), str)):
        return None
    # the entry vouches for itself: its backend must hash to the checksum it records (else it is loaded afresh)
    return cached if hashlib.sha256(cached["backend"].encode()).hexdigest() == cached.get("sha256") else None


def _write_cache(key: str | None, facts: dict[str, Any]) -> None:
    """Record ``facts`` under ``key`` atomically; a cache that cannot be written is no error (loads stay slow)."""
    if key is None:
        return
    target = _cache_path(key)
    temporary = target.with_name(f"{target.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps({"format": _CACHE_FORMAT, **facts}))
        os.replace(temporary, target)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink()


def _reload(name_or_path: str, sha256: str, added_tokens: tuple[str, ...] = ()) -> Tokenizer:
    tokenizer = Tokenizer(name_or_path, added_tokens)
    if tokenizer.sha256 != sha256:
        raise TokenizerError(f"the tokenizer at {name_or_path!r} changed since the build started "
                             f"(sha256 {tokenizer.sha256[:12]}, was {sha256[:12]}); restart the build")
    return tokenizer


@functools.lru_cache(maxsize=8)
def _loaded(name_or_path: str, added_tokens: tuple[str, ...] = ()) -> Tokenizer:
    return Tokenizer(name_or_path, added_tokens)


def recorded_tokenizer(identity: dict[str, Any] | None, where: str) -> Tokenizer:
    """The tokenizer a dataset's metadata records (``identity``), loaded once per process, refused (a
    TokenizerError naming ``where``) unless it loads and is the very one the dataset was built with."""
    if not identity:
        raise TokenizerError(f"{where}: the dataset records no tokenizer, so its texts cannot be decoded; "
                             f"build it with a tokenizer ({option('tokenizer')})")
    try:
        tokenizer = _loaded(identity["name_or_path"], tuple(identity.get("added_tokens", ())))
    except (TokenizerError, OSError, ValueError) as error:
        raise TokenizerError(f"{where}: its tokenizer {identity['name_or_path']!r} does not load "
                             f"({str(error).splitlines()[0][:120]})") from error
    if tokenizer.sha256 != identity.get("sha256"):
        raise TokenizerError(f"{where}: the tokenizer at {identity['name_or_path']!r} is not the one the dataset "
                             "was built with")
    return tokenizer
