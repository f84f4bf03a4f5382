"""``chat``: text-only conversations in FastChat/Modalities JSONL (instruction tuning).

Input: JSONL lines ``{"conversations": [{"from": ..., "value": ...}, ...], ...optional keys}``
(seed 002: the "Fine-tuning Datasets" format). Written as a multimodal-kind dataset whose plans
hold only text elements, so chat data mixes with BAGEL's groups in one training:

* the optional keys named by ``--extra-keys`` (e.g. ``role,instruction``, in that order — the
  Modalities ``message_construction``) that a row has become texts before the conversation,
  without loss (they are context, like the human turns);
* each turn is one text, its value as written: ``gpt``/``assistant`` turns carry loss (loss
  masking as Modalities' ``loss_masking_jq_patterns`` selects human turns and extra keys out),
  ``human``/``user``/``system`` turns do not; any other speaker skips the row as malformed;
* as in BAGEL's ``vlm_sft``: every element has enable_cfg=0, texts with no tokens are dropped,
  and a row without a text with loss is skipped. One view per row (nothing is random).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mmidx.sources import Skip, Skipped, SourceContext, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.common import TextTable, assemble, conversation_turns, plan_conversation, require_loss, samples_of
from mmidx.sources.inputs import jsonl_units, list_inputs, read_jsonl

KIND = "multimodal"
EXTENSIONS = (".jsonl",)
SPEAKER_LOSS = {"human": False, "user": False, "system": False, "gpt": True, "assistant": True}


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """Line-aligned byte ranges of the JSONL inputs."""
    return jsonl_units(list_inputs(inputs, EXTENSIONS), options.bytes_per_shard)


def _sample(row: int, record: dict, context: SourceContext) -> SourceSample:
    turns = conversation_turns(record)
    items = []
    for key in context.options.extra_keys:
        if key in record:
            if not isinstance(record[key], str):
                raise Skipped("malformed_record", f"{key} is not a string: {str(record[key])[:80]!r}")
            items.append(("text", record[key], False))
    for speaker, value in turns:
        if speaker not in SPEAKER_LOSS:
            raise Skipped("malformed_record", f"unknown speaker {speaker!r} (known: {', '.join(SPEAKER_LOSS)})")
        items.append(("text", value, SPEAKER_LOSS[speaker]))
    table = TextTable()
    for _, text, _ in items:
        table.add(text)
    tokens = table.encode(context)
    views = [plan_conversation(items, table, tokens)]
    require_loss(views)
    return assemble(row, views, tokens, lambda j: None)


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """One sample per line."""
    return samples_of(read_jsonl(unit), lambda row, record: _sample(row, record, context))
