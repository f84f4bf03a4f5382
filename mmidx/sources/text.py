"""``text``: plain-text documents in JSONL, written the way Megatron-LM's ``preprocess_data.py`` does.

Input: JSONL lines with a text field (``--text-key``, default ``"text"``). Each document becomes one
token sequence ``tokenizer(text).input_ids + [eod]`` — what ``preprocess_data.py --append-eod``
writes with a Hugging Face tokenizer (``eod`` = the tokenizer's eos id) — in a ``kind="text"``
dataset: one sequence per document, so Megatron's ``IndexedDataset`` and ``GPTDataset`` read it
unchanged. Texts are tokenized in batches by the fast tokenizer's backend.

Rows Megatron would write as empty documents (an empty string) are skipped as ``empty_text``;
a missing or non-string text field is ``malformed_record`` (Megatron stops on those).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mmidx.sources import Skip, SourceContext, SourceDocument, SourceOptions, WorkUnit
from mmidx.sources.inputs import jsonl_units, list_inputs, read_jsonl

KIND = "text"
EXTENSIONS = (".jsonl",)
BATCH_SIZE = 512


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """Line-aligned byte ranges of the JSONL inputs."""
    return jsonl_units(list_inputs(inputs, EXTENSIONS), options.bytes_per_shard)


def _documents(batch: list[tuple[int, str] | Skip], context: SourceContext) -> Iterator[SourceDocument | Skip]:
    texts = [entry[1] for entry in batch if not isinstance(entry, Skip)]
    encoded = iter(context.encode_batch(texts))
    eod = [context.tokenizer.eod]
    for entry in batch:
        yield entry if isinstance(entry, Skip) else SourceDocument(entry[0], next(encoded) + eod)


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceDocument | Skip]:
    """One document per line, tokenized ``BATCH_SIZE`` lines at a time."""
    key = context.options.text_key
    batch: list[tuple[int, str] | Skip] = []
    for item in read_jsonl(unit):
        if not isinstance(item, Skip):
            row, record = item
            text = record.get(key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                item = Skip(row, "malformed_record", f"no string field {key!r}")
            elif not text:
                item = Skip(row, "empty_text", f"field {key!r} is empty")
            else:
                item = (row, text)
        batch.append(item)
        if len(batch) == BATCH_SIZE:
            yield from _documents(batch, context)
            batch = []
    yield from _documents(batch, context)
