"""Truncated, corrupted or mismatched files are refused with FormatError, never read as garbage."""

import os
import shutil

import numpy as np
import pytest
from support.helpers import small_dataset

from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.read.checks import verify
from mmidx.read.dataset import MMIDXDataset

ROLES = ("idx", "bin", "images", "plan", "meta")


@pytest.fixture
def dataset_prefix(tmp_path):
    small_dataset(tmp_path / "ds", count=3)
    return tmp_path / "ds"


def test_the_intact_dataset_opens_and_verifies(dataset_prefix):
    MMIDXDataset(dataset_prefix)
    assert verify(dataset_prefix) == []


@pytest.mark.parametrize("role", ROLES)
def test_truncation_at_every_byte_offset_is_refused_on_open(dataset_prefix, role):
    path = fmt.file_path(dataset_prefix, role)
    original = path.read_bytes()
    for size in range(len(original)):
        path.write_bytes(original[:size])
        with pytest.raises(FormatError, match=path.name.split(".")[0]):
            MMIDXDataset(dataset_prefix)
    path.write_bytes(original)
    MMIDXDataset(dataset_prefix)


def _header_ranges(prefix):
    plan = fmt.file_path(prefix, "plan").read_bytes()
    header_end = fmt.PLAN_PREAMBLE_SIZE + int.from_bytes(plan[16:24], "little")
    return {"idx": range(fmt.MEGATRON_HEADER_SIZE), "plan": range(header_end),
            "meta": range(fmt.file_path(prefix, "meta").stat().st_size)}


def _refused_or_caught(prefix) -> bool:
    try:
        MMIDXDataset(prefix)
    except FormatError:
        return True
    return bool(verify(prefix))


@pytest.mark.parametrize("role", ["idx", "plan", "meta"])
def test_flipping_any_header_byte_is_refused_or_caught_by_verify(dataset_prefix, role):
    path = fmt.file_path(dataset_prefix, role)
    original = path.read_bytes()
    for position in _header_ranges(dataset_prefix)[role]:
        for mask in (0x01, 0x20, 0x80, 0xFF):
            corrupted = bytearray(original)
            corrupted[position] ^= mask
            path.write_bytes(bytes(corrupted))
            assert _refused_or_caught(dataset_prefix), (role, position, mask)
    path.write_bytes(original)


@pytest.mark.parametrize("role", ["bin", "images"])
def test_flipped_data_bytes_are_caught_by_verify(dataset_prefix, role):
    path = fmt.file_path(dataset_prefix, role)
    original = path.read_bytes()
    for position in range(0, len(original), 3):
        corrupted = bytearray(original)
        corrupted[position] ^= 0x5A
        path.write_bytes(bytes(corrupted))
        assert any(path.name in problem for problem in verify(dataset_prefix))
    path.write_bytes(original)


def test_a_bin_file_from_another_dataset_is_refused(tmp_path):
    small_dataset(tmp_path / "a", seed=1)
    small_dataset(tmp_path / "b", seed=2, count=4)
    shutil.copyfile(tmp_path / "b.bin", tmp_path / "a.bin")
    with pytest.raises(FormatError, match=r"a\.bin"):
        MMIDXDataset(tmp_path / "a")


def test_a_bare_megatron_index_with_the_wrong_bin_is_refused(tmp_path):
    fmt.write_token_index(tmp_path / "m.idx", np.dtype(np.uint16), np.array([3, 4]), np.array([0, 2]))
    (tmp_path / "m.bin").write_bytes(b"\x00" * 12)
    with pytest.raises(FormatError, match=r"m\.bin"):
        MMIDXDataset(tmp_path / "m")


def test_missing_files_are_named(dataset_prefix):
    os.remove(fmt.file_path(dataset_prefix, "images"))
    with pytest.raises(FormatError, match=r"ds\.images: missing"):
        MMIDXDataset(dataset_prefix)


def test_no_dataset_at_prefix_is_explained(tmp_path):
    with pytest.raises(FormatError, match="no dataset here"):
        MMIDXDataset(tmp_path / "nothing")


def test_a_newer_format_version_asks_to_upgrade(dataset_prefix):
    path = fmt.file_path(dataset_prefix, "meta")
    meta = fmt.read_metadata(path)
    meta["format_version"] = fmt.READ_FORMAT_VERSION + 1
    path.write_bytes(fmt.serialize_metadata(meta))
    with pytest.raises(FormatError, match="upgrade mmidx"):
        MMIDXDataset(dataset_prefix)


def test_corrupted_interior_pointers_raise_instead_of_reading_outside_the_map(dataset_prefix):
    """A pointer made to point past the .bin (checksums aside) must never be dereferenced."""
    path = fmt.file_path(dataset_prefix, "idx")
    data = bytearray(path.read_bytes())
    header = fmt.read_token_index_header(path)
    second_pointer = header.pointers_offset + 8
    data[second_pointer:second_pointer + 8] = (10**12).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    dataset = MMIDXDataset(dataset_prefix)  # opening checks the first and last pointers only
    with pytest.raises(FormatError, match=r"outside the \.bin"):
        dataset.get_tokens(1)
    with pytest.raises(FormatError, match=r"outside the \.bin"):
        dataset.gather([0, 1])
    assert any("pointers" in problem for problem in verify(dataset_prefix))
