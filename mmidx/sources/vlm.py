"""``vlm``: LLaVA-style conversations over images or a video, BAGEL's ``vlm_sft`` (``data/vlm_dataset.py``).

Input: JSONL lines ``{"conversations": [{"from": "human"|"gpt", "value": ...}], "image": name or
[names]}`` or ``{..., "video": name}``; names are relative to ``--image-root`` (BAGEL's
``data_dir``; default: the JSONL file's folder) unless absolute or URIs. Rules, as BAGEL's
``__iter__`` and ``change_format`` apply them:

* every listed image is loaded (a missing or undecodable one skips the row); ``image`` wins over
  ``video``; a row with neither is a text-only conversation;
* a video (a file, or a folder of frame images when the name ends in ``/``) gives n frames
  (:func:`mmidx.sources.media.frame_indices`: BAGEL's ``FrameSampler`` modes ``rand``, ``middle``,
  ``fpsX``, n in [min_frames, max_frames], default 8..12) and ``<video>`` becomes n × ``<image>``
  in the first turn that contains it. (BAGEL's loop raises unless that is the *first* turn — its
  ``else`` sits under the ``if`` instead of the ``for`` — and so drops such rows; mmidx keeps them.
  A video row without ``<video>`` anywhere is skipped, as in BAGEL.) A draw with no frame, or with
  frames past the end (``fix_start`` too large), skips the row, as BAGEL's failing frame read does;
* ``change_format``: a human turn without ``<image>`` is one text (not stripped); with it, the
  value is split on ``<image>``, each stripped non-empty piece is a text, and an image follows
  every piece but the last while fewer than the sample's image count were placed; a gpt turn is
  one text with loss; other speakers are ignored;
* texts are tokenized with ``tokenizer.encode``; texts with no tokens are dropped; every element
  has enable_cfg=0; images are vit_image elements (loss 0) with ``img_num`` = the number of images
  (or frames) of the sample, which BAGEL's resize rule divides ``max_pixels`` by;
* a row without any text with loss is skipped ("No loss defined").

Views: an image or text row has one view (nothing is random); a video row has K views, K frame
draws seeded by (seed, file, row). The frames are decoded with PyAV and stored once each (the
union over views), losslessly unless ``frame_quality`` is set; ``extra["video_frames"]`` lists
the frame number of each stored image.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mmidx.sources import Skip, Skipped, SourceContext, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.common import (
    ConversationItem,
    TextTable,
    assemble,
    conversation_turns,
    plan_conversation,
    require_loss,
    samples_of,
)
from mmidx.sources.elements import StoredImage
from mmidx.sources.inputs import jsonl_units, list_inputs, parent, read_jsonl, resolve
from mmidx.sources.media import ingest_image_file, sample_video

KIND = "multimodal"
EXTENSIONS = (".jsonl",)


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """Line-aligned byte ranges of the JSONL inputs."""
    return jsonl_units(list_inputs(inputs, EXTENSIONS), options.bytes_per_shard)


def change_format(turns: Sequence[tuple[str, str]], num_images: int) -> list[ConversationItem]:
    """BAGEL's ``change_format``: the conversation as texts (with loss flags) and image placeholders."""
    items: list[ConversationItem] = []
    for speaker, value in turns:
        if speaker == "human":
            if "<image>" not in value:
                items.append(("text", value, False))
                continue
            pieces = value.split("<image>")
            for index, piece in enumerate(pieces):
                if piece.strip():
                    items.append(("text", piece.strip(), False))
                if index != len(pieces) - 1 and index < num_images:
                    items.append(("image", "", False))
        elif speaker == "gpt":
            items.append(("text", value, True))
    return items


def with_video_frames(turns: Sequence[tuple[str, str]], frames: int) -> list[tuple[str, str]]:
    """``<video>`` replaced by ``frames`` × ``<image>`` in the first turn that holds it."""
    for index, (speaker, value) in enumerate(turns):
        if "<video>" in value:
            return [*turns[:index], (speaker, value.replace("<video>", "<image>" * frames)), *turns[index + 1:]]
    raise Skipped("malformed_record", "a video row whose conversation has no <video> placeholder")


def _image_names(value: object) -> list[str]:
    names = value if isinstance(value, list) else [value]
    if not all(isinstance(name, str) for name in names):
        raise Skipped("malformed_record", f"image is neither a file name nor a list of them: {str(value)[:80]!r}")
    return names


def _plan(turn_lists: Sequence[Sequence[tuple[str, str]]], image_lists: Sequence[Sequence[int]],
          context: SourceContext) -> tuple[list[list], list[list[int]]]:
    """Views (one per turn list, with its images) and the tokens of the row's texts."""
    table = TextTable()
    items = [change_format(turns, len(images)) for turns, images in zip(turn_lists, image_lists, strict=True)]
    for view_items in items:
        for kind, text, _ in view_items:
            if kind == "text":
                table.add(text)
    tokens = table.encode(context)
    views = [plan_conversation(view_items, table, tokens, images, max(1, len(images)))
             for view_items, images in zip(items, image_lists, strict=True)]
    require_loss(views)
    return views, tokens


def _placeholder_warnings(turns: Sequence[tuple[str, str]], images: int) -> list[tuple[str, str]]:
    """A warning when the human turns' ``<image>`` count differs from the row's image count (built anyway)."""
    placeholders = sum(value.count("<image>") for speaker, value in turns if speaker == "human")
    if placeholders == images:
        return []
    return [("image_placeholder_mismatch", f"{placeholders} <image> placeholder(s) for {images} image(s)")]


def image_conversation(row: int, turns: Sequence[tuple[str, str]], images: Sequence[StoredImage],
                       context: SourceContext) -> SourceSample:
    """The one-view sample of a conversation over ``images`` (none: a text-only conversation)."""
    views, tokens = _plan([turns], [list(range(len(images)))], context)
    sample = assemble(row, views, tokens, images.__getitem__)
    sample.warnings = _placeholder_warnings(turns, len(images))
    return sample


def _sample(unit: WorkUnit, row: int, record: dict, context: SourceContext) -> SourceSample:
    turns = conversation_turns(record)
    root = context.options.image_root or parent(unit.path)
    if "image" in record:
        stored = [ingest_image_file(resolve(root, name), context) for name in _image_names(record["image"])]
        return image_conversation(row, turns, stored, context)
    if "video" in record:
        video, draws = sample_video(record["video"], root, context.rng(unit.path, row), context)
        union = sorted({number for draw in draws for number in draw})
        position = {number: j for j, number in enumerate(union)}
        views, tokens = _plan([with_video_frames(turns, len(draw)) for draw in draws],
                              [[position[number] for number in draw] for draw in draws], context)
        used = sorted({e.payload for view in views for e in view if e.kind == "vit_image"})
        frames = video.frames(union[j] for j in used)
        return assemble(row, views, tokens, lambda j: frames[union[j]],
                        {"video": record["video"], "video_frames": [union[j] for j in used]})
    return image_conversation(row, turns, [], context)


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """One sample per line; lines that are not usable conversations are skipped."""
    return samples_of(read_jsonl(unit), lambda row, record: _sample(unit, row, record, context))
