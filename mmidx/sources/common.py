"""Pieces several sources share: text tables, caption choice per view, conversation plans, assembly."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from mmidx.sources import Skip, Skipped, SourceContext, SourceSample
from mmidx.sources.elements import Element, StoredImage


class TextTable:
    """The distinct strings of one row, numbered in order of first use, each tokenized once."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self.strings: list[str] = []
        self.tokens: list[list[int]] = []

    def add(self, text: str) -> int:
        """The number of ``text`` in this table (added if new)."""
        if text not in self._ids:
            self._ids[text] = len(self.strings)
            self.strings.append(text)
        return self._ids[text]

    def encode(self, context: SourceContext) -> list[list[int]]:
        """Tokenize every string not tokenized yet (one batch); returns the tokens of all."""
        self.tokens += context.encode_batch(self.strings[len(self.tokens):])
        return self.tokens


def caption_choices(rng: random.Random, captions: int, views: int) -> list[int]:
    """Which caption each view shows: every caption once, in random order, before any repeats.

    BAGEL draws ``random.choice(captions)`` anew every epoch; K views drawn this way instead
    cover min(K, n) distinct captions, and each further round is a fresh shuffle.
    """
    choices: list[int] = []
    while len(choices) < views:
        round_ = list(range(captions))
        rng.shuffle(round_)
        choices += round_
    return choices[:views]


def caption_sample(row: int, captions: Sequence[str], image: StoredImage, rng: random.Random,
                   context: SourceContext) -> SourceSample:
    """A t2i sample: every distinct caption stored once; view v = text(caption, cfg) → noised vae.

    An empty caption list becomes the single caption " ", as BAGEL's ``t2i_dataset`` does.
    """
    table = TextTable()
    for caption in captions or [" "]:
        table.add(caption)
    return SourceSample(row, table.encode(context), [image], caption_views(rng, len(table.strings),
                                                                           context.options.views))


def caption_views(rng: random.Random, captions: int, views: int) -> list[list[Element]]:
    """The views of a t2i sample of ``captions`` distinct captions: text(caption, cfg) → noised vae image."""
    return [[Element("text", pick, enable_cfg=True), Element("vae_image", 0, loss=True)]
            for pick in caption_choices(rng, captions, views)]


ConversationItem = tuple[str, str, bool]  # ("text", text, loss) or ("image", "", False)


def plan_conversation(items: Sequence[ConversationItem], table: TextTable, tokens: Sequence[Sequence[int]],
                      image_payloads: Sequence[int] = (), img_num: int = 1) -> list[Element]:
    """Elements of a conversation as BAGEL's ``vlm_dataset`` builds them (no CFG anywhere).

    Texts that tokenize to nothing are left out; the k-th image item becomes a ViT image of
    ``image_payloads[k]`` with ``img_num`` (the sample's image count, for the resize rule).
    """
    elements, images = [], iter(image_payloads)
    for kind, text, loss in items:
        if kind == "image":
            elements.append(Element("vit_image", next(images), img_num=img_num))
            continue
        number = table.add(text)
        if tokens[number]:
            elements.append(Element("text", number, loss=loss))
    return elements


def require_loss(views: Sequence[Sequence[Element]]) -> None:
    """Skip a conversation none of whose views has an element with loss (BAGEL: "No loss defined")."""
    if not any(element.loss for view in views for element in view):
        raise Skipped("no_loss_turn", "no text with loss (no assistant turn, or only empty ones)")


def assemble(row: int, views: list[list[Element]], tokens: Sequence[Sequence[int]],
             load_image: Callable[[int], StoredImage], extra: dict | None = None) -> SourceSample:
    """Keep the texts and images the views use, in their original order, and renumber payloads.

    ``tokens`` and ``load_image`` are indexed by the row's own numbering; only the images some
    view references are loaded (and so checked and stored), each once.
    """
    used = {"text": sorted({e.payload for view in views for e in view if e.kind == "text"}),
            "image": sorted({e.payload for view in views for e in view if e.kind != "text"})}
    number = {kind: {old: new for new, old in enumerate(olds)} for kind, olds in used.items()}
    images = [load_image(j) for j in used["image"]]
    views = [[replace(e, payload=number["text" if e.kind == "text" else "image"][e.payload]) for e in view]
             for view in views]
    return SourceSample(row, [list(tokens[j]) for j in used["text"]], images, views, extra)


def conversation_turns(record: object) -> list[tuple[str, str]]:
    """(speaker, text) of each turn of a row's ``conversations`` (``[{"from": ..., "value": ...}]``)."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not all(
            isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)
            for turn in turns):
        raise Skipped("malformed_record", "no conversations list of {from, value} strings")
    return [(turn["from"], turn["value"]) for turn in turns]


def samples_of(records: Iterable[tuple[int, Any] | Skip],
               build: Callable[[int, Any], SourceSample]) -> Iterator[SourceSample | Skip]:
    """One sample per (row, record) from ``build``; skips pass through, and a row whose ``build``
    raises ``Skipped`` becomes a counted skip at that row: every row is accounted for."""
    for item in records:
        if isinstance(item, Skip):
            yield item
            continue
        row, record = item
        try:
            yield build(row, record)
        except Skipped as skipped:
            yield skipped.at(row)
