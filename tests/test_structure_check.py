"""The one-pass structure check (csrc/_structure.pyx) accepts exactly the datasets the vectorised checks accept.

Every byte of the token index's and the plan's arrays is overwritten with a few values in turn; whenever the
damaged dataset still opens, the one-pass verdict must equal "the vectorised reference finds no problem", and
``structure_problems`` must list what the reference lists.
"""

import numpy as np
import pytest
from support.helpers import RawSample, build, png_bytes

import mmidx.read.invariants
from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.invariants import structure_problems, structure_sound, vectorised_problems
from mmidx.sources.elements import Element, StoredImage

VALUES = (0x00, 0x01, 0x7F, 0x80, 0xFF)


def _samples(count: int) -> list[RawSample]:
    rng = np.random.default_rng(5)
    samples = []
    for i in range(count):
        texts = [rng.integers(0, 1000, rng.integers(1, 5)).tolist() for _ in range(1 + i % 2)]
        images = [StoredImage(png_bytes(8 + j, 8, (i, j, 0)), 8 + j, 8, "PNG", "RGB") for j in range(i % 3)]
        view = [Element("text", 0, loss=True)] + [Element("vae_image", j) for j in range(len(images))]
        views = [view, [Element("text", len(texts) - 1)]] if i % 2 else [view]
        samples.append(RawSample(texts, images, views, (0 if i % 4 else -1, i), {"n": i} if i % 2 else None))
    return samples


def _array_bytes(prefix) -> dict[str, range]:
    """The byte ranges of each file that hold index arrays (headers are refused on open already)."""
    idx_size = fmt.file_path(prefix, "idx").stat().st_size
    plan = fmt.file_path(prefix, "plan").read_bytes()
    plan_start = fmt.PLAN_PREAMBLE_SIZE + int.from_bytes(plan[16:24], "little")
    return {"idx": range(fmt.MEGATRON_HEADER_SIZE, idx_size), "plan": range(plan_start, len(plan))}


PROBLEMS = ("negative sequence lengths", "sequence pointers", "document indices", "decrease", "without a view",
            "unknown element kinds", "unknown flag bits", "img_num 0", "name a text or image", "width or height",
            "format or mode", "origin")


def _verdicts(prefix, role: str, positions: range) -> dict[str, int]:
    """Damage each byte of ``positions`` in the file ``role``; how many damaged datasets that still opened were
    sound, and how many broke each kind of invariant."""
    path = fmt.file_path(prefix, role)
    original = path.read_bytes()
    found = dict.fromkeys(("sound", *PROBLEMS), 0)
    for position in positions:
        for value in VALUES:
            if original[position] == value:
                continue
            path.write_bytes(original[:position] + bytes([value]) + original[position + 1:])
            try:
                dataset = MMIDXDataset(prefix)
            except FormatError:
                continue
            reference = vectorised_problems(dataset)
            assert structure_sound(dataset) == (reference == []), (role, position, value, reference)
            assert structure_problems(dataset) == reference
            found["sound"] += not reference
            for problem in PROBLEMS:
                found[problem] += any(problem in line for line in reference)
    path.write_bytes(original)
    return {key: count for key, count in found.items() if count}


@pytest.mark.parametrize(("role", "chunk"), [("idx", 1 << 20), ("plan", 1 << 20), ("plan", 2)])
def test_the_one_pass_check_agrees_with_the_vectorised_checks_on_every_damaged_byte(tmp_path, monkeypatch, role, chunk):
    """(Also with the numpy part of the one-pass check taking two views at a time: it must agree across chunks.)"""
    monkeypatch.setattr(mmidx.read.invariants, "_CHUNK", chunk)
    prefix = tmp_path / "ds"
    build(prefix, _samples(9))
    assert structure_sound(MMIDXDataset(prefix)) and vectorised_problems(MMIDXDataset(prefix)) == []
    found = _verdicts(prefix, role, _array_bytes(prefix)[role])
    expected = {"idx": PROBLEMS[:3], "plan": PROBLEMS[3:]}[role]
    assert set(expected) <= set(found), found  # every invariant was broken at least once


def test_the_one_pass_check_agrees_on_a_damaged_megatron_pair(tmp_path):
    prefix = tmp_path / "pair"
    lengths = np.array([3, 0, 5, 2, 7], dtype=np.int32)
    fmt.write_token_index(f"{prefix}.idx", np.dtype(np.uint16), lengths, np.array([0, 2, 2, 5], dtype=np.int64))
    fmt.file_path(prefix, "bin").write_bytes(bytes(2 * int(lengths.sum())))
    found = _verdicts(prefix, "idx", range(fmt.MEGATRON_HEADER_SIZE, fmt.file_path(prefix, "idx").stat().st_size))
    assert {"negative sequence lengths", "sequence pointers", "document indices"} <= set(found)

