"""``video_gen``: captioned clips as video-generation samples, with diffusion forcing and random grouping.

BAGEL trains video and multi-image generation with ``_add_video`` (``data/interleave_datasets/
interleave_t2i_dataset.py``) and groups frames with ``split_integer_exp_decay``
(:mod:`mmidx.sources.grouping`), but ships no dataset that uses them; this source builds such plans.

Input: JSONL lines ``{"video": name, "caption": text or {"0": text, ...}, "condition_frames": c}``.
``video`` is a video file, or a folder of frame images when the name ends in ``/``, relative to
``--image-root`` (default: the JSONL file's folder) unless absolute or a URI, read exactly as the
``vlm`` source reads videos (:func:`mmidx.sources.media.sample_video`: BAGEL's ``FrameSampler``
rules ``rand``, ``middle``, ``fix_start``, ``fpsX``, n in [min_frames, max_frames]; frames decoded
with PyAV and stored once each, losslessly unless ``frame_quality`` is set). The caption field is
``caption_key`` (default ``caption``): a string, or BAGEL's caption dict of strings (an empty dict is
the caption ``" "``, as BAGEL's t2i does). ``condition_frames`` (default 0) is how many leading
frames of each draw are clean conditioning.

The plan of a view (every random choice drawn from the row's seed, so it is fixed per view and
packed sizes are exact):

1. the caption, ``text(enable_cfg=1, loss=0)`` (causal; dropped by CFG dropout like any caption).
   Views pick captions as t2i does: every caption once before any repeats;
2. the first c frames as clean VAE images: ``_add_video(need_vae=True, enable_cfg=True)``, one
   ``full`` split, ``frame_delta`` = next frame number - this one on all but the last frame;
3. the other frames as noised VAE targets (``loss=1, enable_cfg=0``), cut into consecutive groups
   by ``split_integer_exp_decay(rng, n - c, group_decay)`` (or one group with ``grouping=False``).
   Each group is one split: ``split_start`` on its first frame, ``split_end`` on its last. Every
   target frame but the clip's last carries ``frame_delta`` to the next sampled frame.

With one group (``--no-grouping``, or a draw of one group) the targets are exactly what
``_add_video(need_loss=True)`` writes for those frames. With several groups mmidx differs from
calling ``_add_video`` once per group on one point, on purpose: a group's last frame keeps its
``frame_delta`` to the next group's first frame. Called per group, BAGEL's helper would leave it out,
and then (a) the rope id would not advance (noised images advance by 0), so the next group's first
frame would repeat the id of a different frame, and (b) a one-frame group, having no
``frame_delta``, would open a ``noise`` split hidden from every later group while longer groups open
``full`` splits the later groups see. Kept, every rope id follows the frame numbers and every group
but a last one-frame group is ``full`` (that last one is ``noise``, which nothing after it could see
anyway).

What this gives in a packed batch, with no packing rule of its own (``mmidx.pack.builder``): each split
draws one timestep at ``split_start`` and its frames share it, while different groups draw
independent ones (BAGEL's *diffusion forcing* at segment level); conditioning frames carry ``-inf``;
a group attends fully to itself and to everything before it (caption, conditioning frames, earlier
noised groups: each group is denoised conditioned on noisy earlier ones), never to later groups.

A row whose ``condition_frames`` leave no target frame in some view's draw (all frames conditioning,
or more conditioning frames than drawn) is skipped as ``no_target_frames``: a view with nothing to
generate has no loss. A clip of one sampled frame is a t2i sample: caption, then one noised VAE image
in a ``noise`` split. ``extra`` records ``video``, ``video_frames`` (the frame number of each stored
image) and ``condition_frames``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mmidx.sources import Skip, Skipped, SourceContext, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.common import TextTable, assemble, caption_choices, samples_of
from mmidx.sources.elements import Element
from mmidx.sources.grouping import split_integer_exp_decay
from mmidx.sources.inputs import jsonl_units, list_inputs, parent, read_jsonl
from mmidx.sources.media import sample_video

KIND = "multimodal"
EXTENSIONS = (".jsonl",)


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """Line-aligned byte ranges of the JSONL inputs."""
    return jsonl_units(list_inputs(inputs, EXTENSIONS), options.bytes_per_shard)


def clip_elements(payloads: Sequence[int], frame_numbers: Sequence[int], *, loss: bool, enable_cfg: bool = False,
                  group_sizes: Sequence[int] | None = None) -> list[Element]:
    """VAE elements of consecutive frames of a clip, as ``_add_video`` writes them, cut into splits.

    ``payloads[i]`` is the stored image of frame ``frame_numbers[i]``. Every frame but the last has
    ``frame_delta`` = the next frame's number - its own; ``group_sizes`` (default: one group of all)
    cut the frames into consecutive splits. ``loss`` makes noised targets (never CFG-dropped, as
    BAGEL), else clean conditioning images with ``enable_cfg``.
    """
    if len(payloads) != len(frame_numbers):
        raise ValueError(f"{len(payloads)} payloads for {len(frame_numbers)} frame numbers")
    sizes = [len(payloads)] if group_sizes is None else list(group_sizes)
    if sum(sizes) != len(payloads) or min(sizes, default=1) < 1:
        raise ValueError(f"group sizes {sizes} do not cut {len(payloads)} frames into non-empty groups")
    starts, ends, first = set(), set(), 0
    for size in sizes:
        starts.add(first)
        ends.add(first + size - 1)
        first += size
    last = len(payloads) - 1
    return [Element("vae_image", payload, loss=loss, enable_cfg=enable_cfg and not loss,
                    split_start=i in starts, split_end=i in ends,
                    frame_delta=frame_numbers[i + 1] - frame_numbers[i] if i < last else None)
            for i, payload in enumerate(payloads)]


def view_plan(caption: int, payloads: Sequence[int], frame_numbers: Sequence[int], condition_frames: int,
              group_sizes: Sequence[int] | None) -> list[Element]:
    """One view: caption text (CFG-droppable), conditioning frames (clean, one split), target groups."""
    c = condition_frames
    plan = [Element("text", caption, enable_cfg=True)]
    if c:
        plan += clip_elements(payloads[:c], frame_numbers[:c], loss=False, enable_cfg=True)
    return plan + clip_elements(payloads[c:], frame_numbers[c:], loss=True, group_sizes=group_sizes)


def _captions(record: dict, key: str) -> list[str]:
    value = record.get(key)
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and all(isinstance(text, str) for text in value.values()):
        return list(value.values()) or [" "]
    raise Skipped("bad_captions", f"{key!r} is neither a string nor an object of strings: {str(value)[:80]!r}")


def _condition_frames(record: dict) -> int:
    value = record.get("condition_frames", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Skipped("malformed_record", f"condition_frames is not a count of frames (an int >= 0): {value!r}")
    return value


def _sample(unit: WorkUnit, row: int, record: object, context: SourceContext) -> SourceSample:
    if not isinstance(record, dict) or "video" not in record:
        raise Skipped("malformed_record", "a video_gen row is an object with a video (and a caption)")
    options = context.options
    captions = _captions(record, options.caption_key)
    condition = _condition_frames(record)
    rng = context.rng(unit.path, row)
    video, draws = sample_video(record["video"], options.image_root or parent(unit.path), rng, context)
    short = next((draw for draw in draws if len(draw) <= condition), None)
    if short is not None:
        raise Skipped("no_target_frames", f"condition_frames={condition} leaves no frame to generate in a draw of "
                                          f"{len(short)} frame(s); lower condition_frames or raise --min-frames")
    table = TextTable()
    for caption in captions:
        table.add(caption)
    picks = caption_choices(rng, len(table.strings), options.views)
    union = sorted({number for draw in draws for number in draw})
    position = {number: j for j, number in enumerate(union)}
    views = []
    for pick, draw in zip(picks, draws, strict=True):
        targets = len(draw) - condition
        sizes = split_integer_exp_decay(rng, targets, options.group_decay)[0] if options.grouping else None
        views.append(view_plan(pick, [position[number] for number in draw], draw, condition, sizes))
    frames = video.frames(union)
    return assemble(row, views, table.encode(context), lambda j: frames[union[j]],
                    {"video": record["video"], "video_frames": union, "condition_frames": condition})


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """One sample per line; rows without a usable video, caption or frame count are skipped, counted."""
    return samples_of(read_jsonl(unit), lambda row, record: _sample(unit, row, record, context))
