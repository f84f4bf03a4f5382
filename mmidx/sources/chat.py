"""``chat``: text-only conversations in FastChat/Modalities JSONL (instruction tuning).

Input: JSONL lines ``{"conversations": [{"from": ..., "value": ...}, ...], ...optional keys}``
(seed 002: the "Fine-tuning Datasets" format). Written as a multimodal-kind dataset whose plans
hold only text elements, so chat data mixes with BAGEL's groups in one training. Each part of the
prompt (an optional key's string, a turn) is one text element, with loss or without:

* with a chat config (``--chat-config``, :mod:`mmidx.sources.chat_config`): its
  ``message_construction`` orders the parts, its jq ``loss_masking_jq_patterns`` mask parts out of
  the loss, and its ``special_tokens`` (bos, eos) are placed in the parts' tokens;
* without one: the optional keys named by ``--extra-keys`` (e.g. ``role,instruction``, in that
  order) that a row has become texts before the conversation, without loss (they are context, like
  the human turns); ``gpt``/``assistant`` turns carry loss, ``human``/``user``/``system`` turns do
  not; any other speaker skips the row as malformed (:func:`~mmidx.sources.chat_config.default_chat_config`
  is the equivalent config).

As in BAGEL's ``vlm_sft``: every element has enable_cfg=0, texts with no tokens are dropped, and a row
without a text with loss is skipped. One view per row (nothing is random).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from mmidx.sources import Skip, Skipped, SourceContext, SourceError, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.chat_config import Part, masked_parts, parts
from mmidx.sources.common import TextTable, assemble, conversation_turns, require_loss, samples_of
from mmidx.sources.elements import Element
from mmidx.sources.inputs import jsonl_units, list_inputs, read_jsonl

KIND = "multimodal"
EXTENSIONS = (".jsonl",)
SPEAKER_LOSS = {"human": False, "user": False, "system": False, "gpt": True, "assistant": True}


CHECKED_ROWS = 1000  # rows of the first input a chat config's message_construction is checked against


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """Line-aligned byte ranges of the JSONL inputs; with a chat config, a SourceError before anything is built
    when one of its ``message_construction`` keys is in none of the first rows (a misspelt key)."""
    units = jsonl_units(list_inputs(inputs, EXTENSIONS), options.bytes_per_shard)
    if options.chat_config is not None and units:
        keys: set[str] = set()  # the keys the first rows give a value
        for _, item in zip(range(CHECKED_ROWS), read_jsonl(units[0]), strict=False):
            if not isinstance(item, Skip) and isinstance(item[1], dict):
                keys.update(key for key, value in item[1].items() if value is not None)
        missing = [key for key in options.chat_config["message_construction"] if key not in keys]
        if keys and missing:
            raise SourceError(f"{units[0].path}: no row of the first {CHECKED_ROWS:,} has "
                              f"{', '.join(map(repr, missing))} of the chat config's message_construction (they "
                              f"have {', '.join(map(repr, sorted(keys)))}); correct the key")
    return units


def _default_parts(record: Any, extra_keys: Sequence[str]) -> tuple[list[Part], list[bool]]:
    """The parts of a row without a chat config, and which are masked (see the module's docstring)."""
    turns = conversation_turns(record)
    found = []
    for key in extra_keys:
        if key in record:
            if not isinstance(record[key], str):
                raise Skipped("malformed_record", f"{key} is not a string: {str(record[key])[:80]!r}")
            found.append(Part(key, record[key]))
    for turn, (speaker, value) in enumerate(turns):
        if speaker not in SPEAKER_LOSS:
            raise Skipped("malformed_record", f"unknown speaker {speaker!r} (known: {', '.join(SPEAKER_LOSS)})")
        found.append(Part("conversations", value, turn, len(turns), speaker))
    return found, [part.speaker is None or not SPEAKER_LOSS[part.speaker] for part in found]


def _sample(row: int, record: Any, context: SourceContext) -> SourceSample:
    config = context.options.chat_config
    if config is None:
        found, masked = _default_parts(record, context.options.extra_keys)
        tokens: dict[str, Any] = {}
        eos_after = "part"
    else:
        found = parts(record, config["message_construction"])
        masked = masked_parts(record, found, config["message_construction"], config["loss_masking_jq_patterns"])
        tokens, eos_after = config["special_tokens"], config["eos_after"]
    table = TextTable()
    numbers = [table.add(part.text) for part in found]
    encoded = table.encode(context)
    kept = [j for j, number in enumerate(numbers) if encoded[number]]  # texts with no tokens are left out
    bos = context.tokenizer.token_id(tokens["bos_token"]) if "bos_token" in tokens else None
    eos = context.tokenizer.token_id(tokens["eos_token"]) if "eos_token" in tokens else None
    payloads: dict[tuple[int, bool, bool], int] = {}  # (text, bos, eos) → payload: equal texts stored once
    sequences, elements = [], []
    for position, j in enumerate(kept):
        starts = bos is not None and position == 0
        ends = eos is not None and (eos_after == "part" or (eos_after == "loss_part" and not masked[j])
                                    or (eos_after == "sample" and position == len(kept) - 1))
        key = (numbers[j], starts, ends)
        if key not in payloads:
            payloads[key] = len(sequences)
            sequences.append([bos] * starts + list(encoded[numbers[j]]) + [eos] * ends)
        elements.append(Element("text", payloads[key], loss=not masked[j]))
    require_loss([elements])
    return assemble(row, [elements], sequences, lambda j: None)


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """One sample per line."""
    return samples_of(read_jsonl(unit), lambda row, record: _sample(row, record, context))
