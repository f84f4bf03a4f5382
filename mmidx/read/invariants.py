"""What a dataset's files must satisfy before anything is read from them.

The O(1) checks run when a dataset opens (file sizes against the metadata, counts against the token index,
the plan's array shapes); ``structure_problems`` is the O(n) pass over every offset and element record that
the pack and GPT indices run before they size anything, and that ``verify`` reports.
"""

from __future__ import annotations

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
_FEW_RECORDS = 64  # up to this many plan records, element_problem accepts sound ones without numpy
if fmt.ELEMENT_DTYPE.names[:3] + fmt.ELEMENT_DTYPE.names[5:] != ("kind", "flags", "img_num", "payload"):
    raise ImportError(f"mmidx.format's element fields {fmt.ELEMENT_DTYPE.names}: element_problem unpacks "
                      "(kind, flags, img_num, _, _, payload)")


def element_problem(records: np.ndarray, texts: Any, images: Any) -> str | None:
    """What is wrong with plan records whose samples have ``texts`` texts and ``images`` images
    (numbers or per-record arrays), or None: kinds, flags, img_num and payloads are checked.

    One sample's view (a few records, ``texts`` and ``images`` numbers: what every pack reads per sample) is
    accepted in Python ints, ~30x cheaper than numpy's per-call overhead; only a failing one is rescanned below
    for the message."""
    if isinstance(texts, int) and isinstance(images, int) and len(records) <= _FEW_RECORDS and all(
            kind < _KINDS and not flags & ~fmt.KNOWN_FLAGS and img_num >= 1
            and 0 <= payload < (texts if kind == fmt.TEXT else images)
            for kind, flags, img_num, _, _, payload in records.tolist()):
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
    return None


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
    """Whether the dataset breaks none of the invariants :func:`structure_problems` checks: one pass of C."""
    tokens, plan = dataset.tokens, dataset.plan
    return tokens_sound(tokens.sequence_lengths, tokens.sequence_pointers, tokens.document_indices,
                        tokens.dtype.itemsize) and (plan is None or plan_sound(
                            tokens.document_indices, plan, len((dataset.metadata or {}).get("sources", []))))


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
    problem = element_problem(plan["elements"], np.diff(tokens.document_indices)[sample_of_element],
                              np.diff(plan["sample_image_offsets"])[sample_of_element])
    if problem:
        problems.append(f"{where}: {problem}")
    info = plan["image_info"]
    if np.any((info["width"] <= 0) | (info["height"] <= 0)):
        problems.append(f"{where}: images with a non-positive width or height")
    if np.any(info["format"] >= len(fmt.IMAGE_FORMATS)) or np.any(info["mode"] >= len(fmt.IMAGE_MODES)):
        problems.append(f"{where}: images with unknown format or mode codes")
    sources = len((dataset.metadata or {}).get("sources", []))
    origin = plan["sample_origin"][:, 0]
    if np.any((origin < -1) | (origin >= sources)):
        problems.append(f"{where}: samples whose origin names none of the {sources} recorded sources")
    return problems
