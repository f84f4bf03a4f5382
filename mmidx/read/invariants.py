"""What a dataset's files must satisfy before anything is read from them.

The O(1) checks run when a dataset opens (file sizes against the metadata, counts against the token index,
the plan's array shapes); ``structure_problems`` is the O(n) pass over every offset and element record that
the pack and GPT indices run before they size anything, and that ``verify`` reports; ``content_problems``
the O(n) checks of what reads decode (extra data, token ids, special tokens). Readers and the packer call
these same functions on what they read, so ``verify`` and they cannot disagree (docs/guide/verify.md lists
every invariant).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from mmidx import format as fmt
from mmidx._reader import TokenStream
from mmidx._structure import plan_sound, tokens_sound
from mmidx.format import FormatError

if TYPE_CHECKING:  # for annotations only: the dataset module runs these checks when a dataset opens
    from mmidx.read.dataset import MMIDXDataset


def _check_file_sizes(prefix: str, meta: dict[str, Any]) -> None:
    files = meta["files"]  # its roles are those of the dataset's kind (fmt.check_metadata_schema)
    for role in files:
        path = fmt.file_path(prefix, role)
        if not path.exists():
            raise FormatError(f"{path}: missing (the metadata lists it): the build did not finish, rebuild it")
        size = path.stat().st_size
        if size != files[role]["bytes"]:
            raise FormatError(f"{path}: {size} bytes, the metadata says {files[role]['bytes']}: "
                              "the file is truncated or was replaced")


def _check_counts(prefix: str, meta: dict[str, Any], tokens: TokenStream) -> None:
    counts = meta["counts"]
    found = {"samples": tokens.document_count, "sequences": tokens.sequence_count,
             "tokens": tokens.token_count}
    for key, value in found.items():
        if counts.get(key) != value:
            raise FormatError(f"{fmt.file_path(prefix, 'meta')}: the metadata counts {counts.get(key)} {key}, "
                              f"the token index has {value}")
    if meta.get("token_dtype") != tokens.dtype.name:
        raise FormatError(f"{fmt.file_path(prefix, 'meta')}: the metadata says {meta.get('token_dtype')} tokens, "
                          f"the index says {tokens.dtype}")


def _check_plan(prefix: str, meta: dict[str, Any], tokens: TokenStream, plan: dict[str, np.ndarray],
                image_bytes: int) -> None:
    path = fmt.file_path(prefix, "plan")
    samples = tokens.document_count

    def offsets(name: str, length: int) -> int:
        array = plan[name]
        if array.shape != (length + 1,):
            raise FormatError(f"{path}: {name} has shape {array.shape}, expected ({length + 1},)")
        if array[0] != 0 or array[-1] < 0:
            raise FormatError(f"{path}: {name} runs from {array[0]} to {array[-1]}: corrupted")
        return int(array[-1])

    views = offsets("sample_view_offsets", samples)
    images = offsets("sample_image_offsets", samples)
    elements = offsets("view_element_offsets", views)
    stored_bytes = offsets("image_offsets", images)
    expected_shapes = {"sample_origin": (samples, 2), "elements": (elements,), "image_info": (images,)}
    for name, shape in expected_shapes.items():
        if plan[name].shape != shape:
            raise FormatError(f"{path}: {name} has shape {plan[name].shape}, expected {shape}")
    if stored_bytes != image_bytes:
        raise FormatError(f"{fmt.file_path(prefix, 'images')}: {image_bytes} bytes, the image table needs "
                          f"{stored_bytes}")
    if "sample_extra" in plan:
        extra_bytes = offsets("sample_extra_offsets", samples)
        if extra_bytes != len(plan["sample_extra"]):
            raise FormatError(f"{path}: sample_extra holds {len(plan['sample_extra'])} bytes, its offsets need "
                              f"{extra_bytes}")
    counts = meta["counts"]
    for key, value in {"views": views, "elements": elements, "images": images, "image_bytes": image_bytes}.items():
        if counts.get(key) != value:
            raise FormatError(f"{fmt.file_path(prefix, 'meta')}: the metadata counts {counts.get(key)} {key}, "
                              f"the plan has {value}")


_KINDS = len(fmt.KIND_NAMES)
_CHUNK = 1 << 20  # views (or images) the one-pass check's numpy part takes at once
_FEW_RECORDS = 64  # up to this many plan records, element_problem accepts sound ones without numpy
if fmt.ELEMENT_DTYPE.names[:3] + fmt.ELEMENT_DTYPE.names[5:] != ("kind", "flags", "img_num", "payload"):
    raise ImportError(f"mmidx.format's element fields {fmt.ELEMENT_DTYPE.names}: element_problem unpacks "
                      "(kind, flags, img_num, _, _, payload)")


def element_problem(records: np.ndarray, texts: Any, images: Any, view_starts: np.ndarray | None = None
                    ) -> str | None:
    """What is wrong with plan records whose samples have ``texts`` texts and ``images`` images
    (numbers or per-record arrays), or None: kinds, flags, img_num, payloads and split pairing are checked.

    ``records`` are one view, or several whose first records ``view_starts`` marks (a bool per record). Split
    flags pair up as the packer needs (:func:`split_problem`).

    One sample's view (a few records, ``texts`` and ``images`` numbers: what every pack reads per sample) is
    accepted in Python ints, ~30x cheaper than numpy's per-call overhead; only a failing one is rescanned below
    for the message."""
    if isinstance(texts, int) and isinstance(images, int) and view_starts is None and len(records) <= _FEW_RECORDS:
        rows = records.tolist()
        if all(kind < _KINDS and not flags & ~fmt.KNOWN_FLAGS and img_num >= 1
               and 0 <= payload < (texts if kind == fmt.TEXT else images)
               for kind, flags, img_num, _, _, payload in rows) and _splits_pair([row[1] for row in rows]):
            return None
    kind = records["kind"]
    if np.any(kind >= len(fmt.KIND_NAMES)):
        return f"unknown element kinds {sorted(set(kind[kind >= len(fmt.KIND_NAMES)].tolist()))}"
    if np.any(records["flags"] & ~np.uint8(fmt.KNOWN_FLAGS)):
        return "elements with unknown flag bits"
    if np.any(records["img_num"] < 1):
        return "elements with img_num 0"
    payload = records["payload"]
    bad = (payload < 0) | (payload >= np.where(kind == fmt.TEXT, texts, images))
    if np.any(bad):
        return (f"{int(bad.sum())} elements name a text or image their sample does not have "
                f"(first: element {int(np.argmax(bad))}, payload {int(payload[np.argmax(bad)])})")
    return split_problem(records["flags"], view_starts)


def _splits_pair(flags: list[int]) -> bool:
    """:func:`split_problem` on one view's flags, in Python ints (the per-read fast path)."""
    opened = False
    for flag in flags:
        if bool(flag & fmt.FLAG_SPLIT_START) == opened:
            return False
        opened = not flag & fmt.FLAG_SPLIT_END
    return not opened


def split_problem(flags: np.ndarray, view_starts: np.ndarray | None = None) -> str | None:
    """Whether the split flags of views' elements pair up, as the packer needs, or what is wrong.

    A view is a run of whole splits: each split's first element has ``split_start``, its last
    ``split_end`` (one element may have both), and no element lies outside a split. So an element has
    ``split_start`` exactly when it begins its view or follows a ``split_end``, and a view's last element
    has ``split_end``. ``view_starts`` marks each view's first element (default: one view).
    """
    if len(flags) == 0:
        return None
    starts = (flags & fmt.FLAG_SPLIT_START) != 0
    ends = (flags & fmt.FLAG_SPLIT_END) != 0
    if view_starts is None:
        view_starts = np.zeros(len(flags), dtype=bool)
        view_starts[0] = True
    must_start = view_starts.copy()
    must_start[1:] |= ends[:-1]
    view_ends = np.append(view_starts[1:], True)
    bad = (starts != must_start) | (view_ends & ~ends)
    if np.any(bad):
        return (f"{int(bad.sum())} elements whose split flags (split_start, split_end) do not pair up into whole "
                f"splits (first: element {int(np.argmax(bad))})")
    return None


def image_info_problem(info: np.ndarray) -> str | None:
    """What is wrong with ``image_info`` records' flags and pad byte (unknown bits, a nonzero pad), or None."""
    if np.any(info["flags"] & np.uint8(~fmt.KNOWN_IMAGE_FLAGS & 0xFF)):
        return "images with unknown image_info.flags bits"
    if np.any(info["pad"]):
        return "images with a nonzero image_info pad byte"
    return None


def extra_problem(data: bytes) -> str | None:
    """Why one sample's ``sample_extra`` bytes are not a UTF-8 JSON object, or None (empty bytes: no extra)."""
    return None if not data else decode_extra(data)[1]


def decode_extra(data: bytes) -> tuple[dict[str, Any], str | None]:
    """A sample's ``sample_extra`` bytes as the JSON object they hold, and None; or ({}, what is wrong)."""
    try:
        extra = json.loads(data.decode("utf-8")) if data else {}
    except (ValueError, RecursionError) as error:  # ValueError: JSONDecodeError, UnicodeDecodeError
        return {}, f"not JSON ({error})"
    if not isinstance(extra, dict):
        return {}, f"a JSON {type(extra).__name__}, not an object"
    return extra, None


def content_problems(dataset: MMIDXDataset) -> list[str]:
    """The O(n) invariants of what reads decode, beyond the index arrays: every ``sample_extra`` is a JSON
    object (``Sample.extra``), every token id is below the tokenizer's ``vocab_size``, and a dataset with
    a plan records no special token the packer needs as null (``PackBuilder``). Needs a sound structure."""
    problems = []
    meta, plan = dataset.metadata or {}, dataset.plan
    if plan is not None and "sample_extra" in plan:
        offsets, data = plan["sample_extra_offsets"], plan["sample_extra"]
        bad = [(i, problem) for i in np.flatnonzero(np.diff(offsets)).tolist()
               if (problem := extra_problem(data[offsets[i]:offsets[i + 1]].tobytes()))]
        if bad:
            problems.append(f"{dataset.prefix}.plan: {len(bad)} samples' extra data is not a JSON object "
                            f"(first: sample {bad[0][0]}, {bad[0][1]})")
    vocab_size = (meta.get("tokenizer") or {}).get("vocab_size")
    if vocab_size is not None and dataset.tokens.token_count:
        try:
            tokens = dataset.tokens.tokens
        except TypeError:  # read by byte range: the largest id is checked where each text is read
            tokens = None
        if tokens is not None:
            top = int(tokens.max())
            if top >= vocab_size or (tokens.dtype.kind == "i" and int(tokens.min()) < 0):
                problems.append(f"{dataset.prefix}.bin: token ids outside the tokenizer's vocabulary of {vocab_size} "
                                f"(largest {top}): the metadata's tokenizer.vocab_size is not the tokenizer's")
    # mmidx's tokenizer adds all four; a dataset built without one records none (the packer is then given them);
    # a text dataset's packs hold no image, so it needs only the ids that frame texts
    special = meta.get("special_tokens", {})
    needed = [name for name in fmt.PACK_SPECIAL_TOKENS if plan is not None or name not in fmt.IMAGE_SPECIAL_TOKENS]
    null = [name for name in needed if name in special and special[name] is None]
    if null:
        problems.append(f"{fmt.file_path(dataset.prefix, 'meta')}: special_tokens {null} are null: the packer "
                        "cannot build a batch of this dataset (rebuild it with a tokenizer that has them)")
    return problems


def structure_problems(dataset: MMIDXDataset) -> list[str]:
    """Every O(n) structural invariant the dataset's index arrays break (empty = sound).

    Opening checks only what is O(1); reads check what they use. Whatever sizes something from
    whole arrays (GPT and pack indices) runs this first, so no corrupted value can make it
    allocate or index out of proportion (``MMIDXDataset.check_structure``); ``mmidx verify`` reports it.
    A sound dataset is accepted by one pass of C over the arrays (``csrc/_structure.pyx``, ~20x cheaper
    than the vectorised checks, which allocate a temporary per check); only one that fails is rescanned
    by :func:`vectorised_problems` for the messages.
    """
    return [] if structure_sound(dataset) else vectorised_problems(dataset)


def structure_sound(dataset: MMIDXDataset) -> bool:
    """Whether the dataset breaks none of the invariants :func:`structure_problems` checks: one pass of C, then
    split pairing and ``image_info``'s flags and pad in numpy."""
    tokens, plan = dataset.tokens, dataset.plan
    if not tokens_sound(tokens.sequence_lengths, tokens.sequence_pointers, tokens.document_indices,
                        tokens.dtype.itemsize):
        return False
    if plan is None:
        return True
    if not plan_sound(tokens.document_indices, plan, len((dataset.metadata or {}).get("sources", []))):
        return False
    offsets, flags, info = plan["view_element_offsets"], plan["elements"]["flags"], plan["image_info"]
    for first in range(0, len(offsets) - 1, _CHUNK):  # whole views at a time: temporaries stay a chunk's
        bounds = np.asarray(offsets[first:first + _CHUNK + 1], dtype=np.int64)
        view_starts = np.zeros(int(bounds[-1] - bounds[0]), dtype=bool)
        view_starts[bounds[:-1][np.diff(bounds) > 0] - bounds[0]] = True
        if split_problem(flags[bounds[0]:bounds[-1]], view_starts) is not None:
            return False
    return all(image_info_problem(info[first:first + _CHUNK]) is None for first in range(0, len(info), _CHUNK))


def vectorised_problems(dataset: MMIDXDataset) -> list[str]:
    """What :func:`structure_problems` finds, each broken invariant in words, by numpy's whole-array
    operations: the reference the one-pass check is tested against, and the explanation of its failures."""
    tokens, problems = dataset.tokens, []
    where = f"{dataset.prefix}.idx"
    lengths = tokens.sequence_lengths
    if np.any(lengths < 0):
        problems.append(f"{where}: {int(np.sum(lengths < 0))} negative sequence lengths")
    elif not np.array_equal(tokens.sequence_pointers, fmt.sequence_pointers(lengths, tokens.dtype.itemsize)):
        problems.append(f"{where}: sequence pointers are not the cumulative sequence lengths")
    if np.any(np.diff(tokens.document_indices) < 0):
        problems.append(f"{where}: document indices decrease")
    plan = dataset.plan
    if plan is None or problems:
        return problems  # the plan checks below index with the document indices
    where = f"{dataset.prefix}.plan"
    for name in ("sample_view_offsets", "sample_image_offsets", "view_element_offsets", "image_offsets",
                 "sample_extra_offsets"):
        if name in plan and np.any(np.diff(plan[name]) < 0):
            problems.append(f"{where}: {name} decrease")
    if problems:
        return problems  # the per-element checks below index with these offsets
    if np.any(np.diff(plan["sample_view_offsets"]) == 0):
        return [f"{where}: samples without a view"]
    sample_of_element = dataset.element_samples()
    view_starts = np.zeros(len(plan["elements"]), dtype=bool)
    view_starts[plan["view_element_offsets"][:-1][np.diff(plan["view_element_offsets"]) > 0]] = True
    problem = element_problem(plan["elements"], np.diff(tokens.document_indices)[sample_of_element],
                              np.diff(plan["sample_image_offsets"])[sample_of_element], view_starts)
    if problem:
        problems.append(f"{where}: {problem}")
    info = plan["image_info"]
    if np.any((info["width"] <= 0) | (info["height"] <= 0)):
        problems.append(f"{where}: images with a non-positive width or height")
    if np.any(info["format"] >= len(fmt.IMAGE_FORMATS)) or np.any(info["mode"] >= len(fmt.IMAGE_MODES)):
        problems.append(f"{where}: images with unknown format or mode codes")
    problem = image_info_problem(info)
    if problem:
        problems.append(f"{where}: {problem}")
    sources = len((dataset.metadata or {}).get("sources", []))
    origin = plan["sample_origin"][:, 0]
    if np.any((origin < -1) | (origin >= sources)):
        problems.append(f"{where}: samples whose origin names none of the {sources} recorded sources")
    return problems
