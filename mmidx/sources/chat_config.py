"""What a ``chat`` row trains on: the parts of its prompt, which carry loss, and its special tokens.

Seed 002's "Fine-tuning Datasets" (FastChat-style JSONL) configures this with three YAML keys; mmidx adds one:

``message_construction``
    The row's keys in prompt order. A string value is one part; a list value is one part per item, each a
    turn object whose text is its ``value`` (FastChat) or ``content`` (``messages`` with ``role``/``content``)
    string. A key a row lacks (or holds null) gives no part; any other value skips the row
    (``malformed_record``), as does a pattern that fails on it.
``loss_masking_jq_patterns``
    jq programs (the reference jq, through the ``jq`` package). A part carries no loss when a pattern selects
    it. Each part is tested on its own document: the row in which every list that ``message_construction``
    names is replaced by the part's own turn (for a turn) or by null (for every other part); the pattern
    selects the part when ``path(pattern)`` yields the part's key. So ``.conversations | select(.from ==
    "human")`` selects the human turns and ``.instruction`` the instruction. ``$turn`` and ``$turns`` hold
    the turn's number (from 0) and the list's length (0 and 1 for a string part):
    ``.messages | select(.role != "assistant" or $turn < $turns - 1)`` keeps loss on the last answer only.
``special_tokens``
    ``bos_token`` starts the sample (the first tokens of its first part); ``eos_token`` ends parts as
    ``eos_after`` says. Each is one id: a string the tokenizer already encodes as one id keeps it, any other
    is added to the tokenizer as a special token (see :mod:`mmidx.tokenizer`; the dataset's tokenizer identity
    records each string's id). A string with spaces at its ends is refused: it would take the spaces of
    ordinary text.
``eos_after`` (mmidx)
    ``part`` (default: after every part), ``loss_part`` (after each part that carries loss, e.g. each
    assistant turn) or ``sample`` (once, after the last part). An eos belongs to the part it ends, so it
    carries that part's loss: a model learns to stop after an answer, not after a question.

Parts whose text is empty are left out (BAGEL drops empty texts), and a row none of whose parts carries loss
is skipped (``no_loss_turn``). Without a config, a chat build keeps the behaviour it always had, which is
:func:`default_chat_config`: the ``--extra-keys`` and the conversation, human/user/system turns and the
extra keys masked, no special tokens, and a turn of any other speaker skips its row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from mmidx.errors import MMIDXError
from mmidx.sources import Skipped

KEYS = ("special_tokens", "loss_masking_jq_patterns", "message_construction", "eos_after")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token")
EOS_AFTER = ("part", "loss_part", "sample")
DEFAULT_MASKED_SPEAKERS = ("human", "user", "system")
DEFAULT_LOSS_SPEAKERS = ("gpt", "assistant")


class ChatConfigError(MMIDXError, ValueError):
    """A chat config that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Part:
    """One part of a row's prompt: ``key``'s string, or turn ``turn`` of ``turns`` in ``key``'s list."""

    key: str
    text: str
    turn: int = 0
    turns: int = 1
    speaker: str | None = None  # a turn's "from" (or "role")


def default_chat_config(extra_keys: Sequence[str] = ()) -> dict[str, Any]:
    """The config equivalent to a chat build without one: ``extra_keys`` (context), then the conversation, with
    loss on gpt/assistant turns only (a build without a config also skips rows with other speakers)."""
    speakers = " or ".join(f".from == {json.dumps(name)}" for name in DEFAULT_MASKED_SPEAKERS)
    return {"special_tokens": {}, "message_construction": [*extra_keys, "conversations"],
            "loss_masking_jq_patterns": [f".conversations | select({speakers})",
                                         *(f".{json.dumps(key)}" for key in extra_keys)],
            "eos_after": "part"}


def load_chat_config(path: str | os.PathLike) -> dict[str, Any]:
    """The chat config in YAML file ``path``, checked (every pattern compiled), as a plain mapping that a build
    records; a ChatConfigError names what is wrong in one line."""
    import yaml

    try:
        with open(path) as stream:
            loaded = yaml.safe_load(stream)
    except OSError as error:
        raise ChatConfigError(f"cannot read the chat config {path}: {error.strerror or error}") from error
    except yaml.YAMLError as error:
        raise ChatConfigError(f"{path}: not valid YAML: {' '.join(str(error).split())}") from error
    return checked_chat_config(loaded, str(path))


def checked_chat_config(config: Any, where: str = "chat config") -> dict[str, Any]:
    """``config`` (a parsed YAML mapping) with its defaults filled in, or a ChatConfigError naming ``where``."""
    if not isinstance(config, dict):
        raise ChatConfigError(f"{where}: expected a mapping with keys {', '.join(KEYS)}")
    unknown = sorted(set(config) - set(KEYS), key=str)
    if unknown:
        raise ChatConfigError(f"{where}: unknown key {unknown[0]!r}; a chat config has {', '.join(KEYS)}")
    tokens = config.get("special_tokens") or {}
    if not isinstance(tokens, dict) or set(tokens) - set(SPECIAL_TOKEN_KEYS):
        raise ChatConfigError(f"{where}: special_tokens maps {' and/or '.join(SPECIAL_TOKEN_KEYS)} to strings, "
                              f"not {tokens!r}")
    for name, token in tokens.items():
        if not isinstance(token, str) or not token.strip() or token != token.strip():
            raise ChatConfigError(f"{where}: special_tokens.{name} must be a string without spaces at its ends (as a "
                                  f"special token it would take the spaces of ordinary text), not {token!r}")
    construction = config.get("message_construction")
    if not isinstance(construction, list) or not construction or not all(
            isinstance(key, str) and key for key in construction) or len(set(construction)) != len(construction):
        raise ChatConfigError(f"{where}: message_construction must list the row's keys in prompt order, each "
                              f"once (e.g. [instruction, conversations]), not {construction!r}")
    patterns = config.get("loss_masking_jq_patterns", [])
    if not isinstance(patterns, list) or not all(isinstance(pattern, str) for pattern in patterns):
        raise ChatConfigError(f"{where}: loss_masking_jq_patterns must be a list of jq programs, not {patterns!r}")
    for pattern in patterns:
        try:
            _compile(pattern)
            _program((pattern,))
        except ValueError as error:
            message = " ".join(str(error).split("\n", 1)[0].split())
            raise ChatConfigError(f"{where}: the loss masking pattern {pattern!r} is not valid jq ({message})") \
                from error
    eos_after = config.get("eos_after", "part")
    if eos_after not in EOS_AFTER:
        raise ChatConfigError(f"{where}: eos_after is one of {', '.join(EOS_AFTER)}, not {eos_after!r}")
    return {"special_tokens": dict(tokens), "message_construction": list(construction),
            "loss_masking_jq_patterns": list(patterns), "eos_after": eos_after}


def special_token_texts(config: dict[str, Any] | None) -> tuple[str, ...]:
    """The special token strings a config adds to the tokenizer (bos, then eos), each once."""
    tokens = (config or {}).get("special_tokens") or {}
    return tuple(dict.fromkeys(tokens[name] for name in SPECIAL_TOKEN_KEYS if name in tokens))


def parts(record: Any, construction: Sequence[str]) -> list[Part]:
    """The parts of ``record`` in ``construction`` order (Skipped when a value has the wrong shape)."""
    if not isinstance(record, dict):
        raise Skipped("malformed_record", "a row must be a JSON object")
    found = []
    for key in construction:
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            found.append(Part(key, value))
        elif isinstance(value, list):
            for turn, item in enumerate(value):
                text = item.get("value", item.get("content")) if isinstance(item, dict) else None
                if not isinstance(text, str):
                    raise Skipped("malformed_record", f"{key}[{turn}] is not a turn with a value (or content) "
                                                      f"string: {str(item)[:80]!r}")
                speaker = item.get("from", item.get("role"))
                found.append(Part(key, text, turn, len(value), speaker if isinstance(speaker, str) else None))
        else:
            raise Skipped("malformed_record", f"{key} is neither a string nor a list of turns: {str(value)[:80]!r}")
    return found


def masked_parts(record: dict[str, Any], found: Sequence[Part], construction: Sequence[str],
                 patterns: Sequence[str]) -> list[bool]:
    """Whether each part is selected by a pattern (so carries no loss); one jq run per row."""
    if not patterns or not found:
        return [False] * len(found)
    lists = [key for key in construction if isinstance(record.get(key), list)]
    documents = []
    for part in found:
        document = {**record, **dict.fromkeys(lists)}
        if part.key in lists:
            document[part.key] = record[part.key][part.turn]
        documents.append({"doc": document, "turn": part.turn, "turns": part.turns})
    program = _program(tuple(patterns))
    try:
        selected = program.input_value(documents).first()
    except ValueError as error:
        raise Skipped("malformed_record", f"a loss masking pattern fails on this row: "
                                          f"{' '.join(str(error).split())[:160]}") from error
    return [[part.key] in paths for part, paths in zip(found, selected, strict=True)]


@lru_cache(maxsize=64)
def _program(patterns: tuple[str, ...]) -> Any:
    """One jq program over a row's part documents: for each, the paths every pattern selects."""
    paths = ", ".join(f"path({pattern})" for pattern in patterns)
    return _compile(f"map(.turn as $turn | .turns as $turns | .doc | [{paths}])")


def _compile(program: str) -> Any:
    """``program`` compiled by the reference jq, with ``$turn`` and ``$turns`` defined."""
    try:
        import jq
    except ImportError as error:
        raise ChatConfigError('loss_masking_jq_patterns need the jq package: pip install "mmidx[chat]"') from error
    return jq.compile(program, args={"turn": 0, "turns": 1})
