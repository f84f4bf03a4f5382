"""Regression tests of issue 8: no byte pattern in any file crashes a reader, downgrades a dataset
silently, or surfaces as anything but a FormatError naming the file; verify tells the truth."""

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xxhash
from support.helpers import png_bytes, small_dataset
from support.packing import build_groups, config_of

from mmidx import format as fmt
from mmidx.cli import main
from mmidx.format import FormatError
from mmidx.index.pack_index import build_pack_index
from mmidx.ingest.writer import DatasetBuilder
from mmidx.pack.builder import PackBuilder
from mmidx.read.checks import verify
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.invariants import element_problem, split_problem
from mmidx.train.gpt import GPTTextDataset


@pytest.fixture
def prefix(tmp_path):
    small_dataset(tmp_path / "ds", count=3)
    return tmp_path / "ds"


def _overwrite(path, offset, data):
    content = bytearray(path.read_bytes())
    content[offset:offset + len(data)] = data
    path.write_bytes(bytes(content))


def _resign(prefix, edit=lambda meta: None):
    """Recompute the metadata's file checksums (after an edit of ``meta``): only structure can object."""
    path = fmt.file_path(prefix, "meta")
    meta = json.loads(path.read_bytes())
    for role, entry in meta["files"].items():
        path_of_role = fmt.file_path(prefix, role)
        algorithm = fmt.file_hash_algorithm(entry)
        entry.update({"bytes": path_of_role.stat().st_size, algorithm: fmt.hash_file(path_of_role, algorithm)})
    edit(meta)
    path.write_bytes(fmt.serialize_metadata(meta))


# ------------------------------------------------------------------ 1. memory safety


@pytest.mark.parametrize("pointer", [2**63 - 8, 2**63 - 1, 2**62, -(2**63), 2**64 - 8, 3])
def test_a_wild_sequence_pointer_is_a_format_error_not_a_segfault(prefix, pointer):
    """Run in a subprocess: a read at bin + 2^63 would kill pytest rather than fail the test."""
    header = fmt.read_token_index_header(fmt.file_path(prefix, "idx"))
    _overwrite(fmt.file_path(prefix, "idx"), header.pointers_offset + 8,
               (pointer % 2**64).to_bytes(8, "little"))
    script = textwrap.dedent(f"""
        from mmidx.read.dataset import MMIDXDataset
        from mmidx.format import FormatError
        ds = MMIDXDataset({str(prefix)!r})
        for read in (lambda: ds[0].texts[1], lambda: ds.gather([0, 1, 2]), lambda: ds.get_tokens(1, 0, 1)):
            try:
                read()
            except FormatError as error:
                assert "ds.idx" in str(error) and "outside the .bin" in str(error), error
            else:
                raise AssertionError("read through a wild pointer")
        print("refused")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "refused", (run.returncode, run.stderr[-2000:])


def test_a_negative_sequence_length_is_a_format_error(prefix):
    _overwrite(fmt.file_path(prefix, "idx"), fmt.MEGATRON_HEADER_SIZE, (-5).to_bytes(4, "little", signed=True))
    dataset = MMIDXDataset(prefix)
    with pytest.raises(FormatError, match=r"ds\.idx: sequence 0 has a negative length"):
        dataset.get_tokens(0)
    with pytest.raises(FormatError, match=r"ds\.idx: sequence 0 has a negative length"):
        dataset.gather([0])


def test_document_indices_out_of_order_are_refused_at_the_read(prefix):
    header = fmt.read_token_index_header(fmt.file_path(prefix, "idx"))
    _overwrite(fmt.file_path(prefix, "idx"), header.documents_offset + 8, (2**40).to_bytes(8, "little"))
    dataset = MMIDXDataset(prefix)
    with pytest.raises(FormatError, match=r"ds\.idx: document_indices"):
        dataset[0].text(0)


@pytest.mark.parametrize(("array", "field", "value"), [
    ("sample_image_offsets", None, 2**40), ("view_element_offsets", None, -3), ("image_offsets", None, 2**62),
    ("elements", "payload", 7), ("elements", "kind", 9), ("image_info", "width", 0), ("sample_view_offsets", None, 0),
])
def test_plan_indexes_are_checked_where_they_are_used(prefix, array, field, value):
    path = fmt.file_path(prefix, "plan")
    dtype = fmt.PLAN_ARRAYS[array]
    field_offset, width = (dtype.fields[field][1], dtype[field].itemsize) if field else (0, dtype.itemsize)
    # the second record of the array (sample 1's entry of the offsets arrays)
    _overwrite(path, _array_offsets(path)[array] + dtype.itemsize + field_offset,
               (value % 2 ** (8 * width)).to_bytes(width, "little"))
    dataset = MMIDXDataset(prefix)
    with pytest.raises(FormatError, match=r"ds\.plan"):
        for sample in (dataset[i] for i in range(len(dataset))):
            sample.images, [sample.elements(v) for v in range(sample.num_views)]
    with pytest.raises(FormatError, match=r"ds\.plan"):
        dataset.check_structure()


def _array_offsets(path):
    data = path.read_bytes()
    size = int.from_bytes(data[16:24], "little")
    header = json.loads(data[fmt.PLAN_PREAMBLE_SIZE:fmt.PLAN_PREAMBLE_SIZE + size])
    return {entry["name"]: entry["offset"] for entry in header["arrays"]}


def test_a_plan_dtype_numpy_cannot_parse_is_a_format_error(prefix):
    """Found by the fuzzer: numpy's dtype-string parser raises SyntaxError on "08i" (a flipped byte)."""
    path = fmt.file_path(prefix, "plan")
    content = path.read_bytes()
    at = content.index(b'"dtype":"<i8"') + len(b'"dtype":"')
    _overwrite(path, at, b"08i")
    with pytest.raises(FormatError, match=r"\.plan: plan array .* malformed header entry"):
        MMIDXDataset(prefix)


def test_undecodable_extra_json_is_a_format_error(tmp_path):
    with DatasetBuilder(tmp_path / "p", vocab_size=100) as builder:
        builder.add_sample([[1, 2]], [], [[]], extra={"prompt_id": "abc"})
        builder.finalize()
    path = fmt.file_path(tmp_path / "p", "plan")
    _overwrite(path, _array_offsets(path)["sample_extra"], b"\xff")
    with pytest.raises(FormatError, match=r"p\.plan: extra data of sample 0"):
        assert MMIDXDataset(tmp_path / "p")[0].extra is None


# ------------------------------------------------------------------ 2. no silent downgrade


@pytest.mark.parametrize("beside", [("plan",), ("images",), ("plan", "images")])
def test_a_multimodal_dataset_without_metadata_is_refused_naming_it(prefix, beside):
    os.remove(fmt.file_path(prefix, "meta"))
    for role in {"plan", "images"} - set(beside):
        os.remove(fmt.file_path(prefix, role))
    with pytest.raises(FormatError, match=r"ds\.meta\.json: missing"):
        MMIDXDataset(prefix)
    assert verify(prefix) and "ds.meta.json: missing" in verify(prefix)[0]


# ------------------------------------------------------------------ 3. metadata schema


SCHEMA_BREAKS = {
    "counts": lambda meta: meta.update(counts=3),
    "counts.samples": lambda meta: meta["counts"].update(samples=True),
    "files": lambda meta: meta.update(files=False),
    "files.bin.bytes": lambda meta: meta["files"]["bin"].update(bytes="32"),
    "files.idx.xxh3_128": lambda meta: meta["files"]["idx"].update(xxh3_128=None),
    "files.bin": lambda meta: meta["files"]["bin"].update(sha256="0" * 64),
    "sources": lambda meta: meta.update(sources=None),
    "special_tokens.eod": lambda meta: meta["special_tokens"].update(eod=2**63),
    "special_tokens": lambda meta: meta.update(special_tokens=[1]),
    "tokenizer": lambda meta: meta.update(tokenizer=7),
    "kind": lambda meta: meta.update(kind={"multimodal": 1}),
    "format_version": lambda meta: meta.update(format_version="1"),
    "token_dtype": lambda meta: meta.update(token_dtype={"a": 1}),
    "build": lambda meta: meta.update(build=[]),
}


@pytest.mark.parametrize("field", sorted(SCHEMA_BREAKS))
def test_metadata_of_the_wrong_shape_is_a_format_error_naming_the_field(prefix, field, capsys):
    _resign(prefix, SCHEMA_BREAKS[field])
    with pytest.raises(FormatError, match=rf"ds\.meta\.json: metadata field '{field}'"):
        MMIDXDataset(prefix)
    assert main(["verify", str(prefix)]) == 1
    assert main(["inspect", str(prefix)]) == 1
    err = capsys.readouterr().err
    assert f"'{field}'" in err and "Traceback" not in err


def test_builders_record_xxh3_128_checksums_of_the_files(prefix):
    meta = json.loads(fmt.file_path(prefix, "meta").read_bytes())
    for role, entry in meta["files"].items():
        assert set(entry) == {"name", "bytes", "xxh3_128"}
        assert entry["xxh3_128"] == xxhash.xxh3_128(fmt.file_path(prefix, role).read_bytes()).hexdigest()


def test_a_dataset_with_sha256_checksums_as_written_before_still_verifies(prefix):
    def to_sha256(meta):
        for role, entry in meta["files"].items():
            del entry["xxh3_128"]
            entry["sha256"] = hashlib.sha256(fmt.file_path(prefix, role).read_bytes()).hexdigest()

    _resign(prefix, to_sha256)
    assert len(MMIDXDataset(prefix)) == 3
    assert verify(prefix) == []
    images = fmt.file_path(prefix, "images")
    _overwrite(images, 0, bytes([images.read_bytes()[0] ^ 1]))
    assert verify(prefix) == [f"{images}: sha256 checksum differs from the metadata: "
                              "the file was modified or corrupted"]


def test_a_text_dataset_whose_metadata_lists_image_files_is_refused(tmp_path):
    with DatasetBuilder(tmp_path / "t", kind="text", vocab_size=100) as builder:
        builder.add_document([[1, 2, 3]])
        builder.finalize()

    def list_images(meta):
        meta["files"]["images"] = {"bytes": 0, "name": "t.images", "sha256": "0" * 64}

    _resign(tmp_path / "t", list_images)
    with pytest.raises(FormatError, match=r"t\.meta\.json: metadata field 'files' lists \['bin', 'idx', 'images'\]"):
        MMIDXDataset(tmp_path / "t")


# ------------------------------------------------------------------ 4. no resource amplification


def test_a_corrupted_length_is_refused_before_the_gpt_index_is_sized_from_it(tmp_path):
    with DatasetBuilder(tmp_path / "t", kind="text", vocab_size=100, special_tokens={"eod": 0}) as builder:
        for _ in range(4):
            builder.add_document([[5, 6, 7, 0]])
        builder.finalize()
    _overwrite(tmp_path / "t.idx", fmt.MEGATRON_HEADER_SIZE + 4, (2**31 - 1).to_bytes(4, "little"))
    MMIDXDataset(tmp_path / "t")  # opening is O(1): the last pointer and length still agree with the .bin
    with pytest.raises(FormatError, match=r"t\.idx: sequence pointers are not the cumulative sequence lengths"):
        GPTTextDataset(tmp_path / "t", seq_length=4)


# ------------------------------------------------------------------ 5. both decode paths check sizes


@pytest.fixture(scope="module")
def pack_setup(tmp_path_factory):
    return build_groups(tmp_path_factory.mktemp("hardening"))


@pytest.mark.parametrize("decode_images", ["loader", "device"])
def test_an_image_table_size_that_disagrees_with_the_image_is_refused_on_both_paths(pack_setup, tmp_path,
                                                                                    decode_images):
    groups = {"t2i": dict(pack_setup["t2i"], datasets=[str(tmp_path / "t2i")])}
    for role in ("idx", "bin", "images", "plan", "meta"):
        source = fmt.file_path(pack_setup["t2i"]["datasets"][0], role)
        fmt.file_path(tmp_path / "t2i", role).write_bytes(source.read_bytes())
    path = fmt.file_path(tmp_path / "t2i", "plan")
    info = _array_offsets(path)["image_info"]
    width = int.from_bytes(path.read_bytes()[info:info + 4], "little")
    _overwrite(path, info, (width + 16).to_bytes(4, "little"))  # image 0 is 16 pixels wider on paper
    config = config_of(groups)
    index = build_pack_index(config, num_samples=4)
    builder = PackBuilder(config, decode_images=decode_images)
    with pytest.raises(FormatError, match=rf"t2i\.images: image 0 of sample 0 decodes to {width}x\d+, "
                                          rf"but the image table \(image_info\) says {width + 16}x"):
        for pack in range(len(index)):
            if any(item.sample == 0 for item in index.items(pack)):
                builder.build(pack, index.items(pack)).to("cpu").to_dict()


def test_split_flags_that_do_not_make_whole_splits_are_a_format_error(pack_setup, tmp_path):
    groups = {"t2i": dict(pack_setup["t2i"], datasets=[str(tmp_path / "t2i")])}
    for role in ("idx", "bin", "images", "plan", "meta"):
        source = fmt.file_path(pack_setup["t2i"]["datasets"][0], role)
        fmt.file_path(tmp_path / "t2i", role).write_bytes(source.read_bytes())
    path = fmt.file_path(tmp_path / "t2i", "plan")
    flags = _array_offsets(path)["elements"] + 1  # the first element (sample 0's text) loses its split_end
    _overwrite(path, flags, bytes([path.read_bytes()[flags] & ~fmt.FLAG_SPLIT_END]))
    # verify, the pack index and a sample's read all refuse it by the one invariant (split_problem)
    _resign(tmp_path / "t2i")
    assert verify(tmp_path / "t2i") == [f"{tmp_path / 't2i'}.plan: 1 elements whose split flags (split_start, "
                                        "split_end) do not pair up into whole splits (first: element 1)"]
    with pytest.raises(FormatError, match=r"t2i\.plan: 1 elements whose split flags"):
        build_pack_index(config_of(groups), num_samples=4)
    with pytest.raises(FormatError, match=r"t2i\.plan: view 0 of sample 0: 1 elements whose split flags"):
        MMIDXDataset(tmp_path / "t2i")[0].elements(0)


# each element's flags as 1 = split_start, 2 = split_end, 3 = both
@pytest.mark.parametrize(("flags", "whole"), [([3], True), ([1, 2], True), ([1, 0, 2, 3], True), ([1, 3], False),
                                              ([3, 2], False), ([1, 1, 2], False), ([2, 3], False), ([0, 3], False),
                                              ([3, 1], False), ([1], False)])
def test_split_flag_sequences_that_the_packer_cannot_close_are_refused(flags, whole):
    records = np.zeros(len(flags), fmt.ELEMENT_DTYPE)
    records["img_num"] = 1
    records["flags"] = [(f & 1) * fmt.FLAG_SPLIT_START | (f >> 1) * fmt.FLAG_SPLIT_END for f in flags]
    problem = element_problem(records, 1, 1)
    assert (problem is None) == whole and (split_problem(records["flags"]) is None) == whole, (flags, problem)


def test_every_unknown_element_kind_is_named_the_first_one_past_the_known_included():
    records = np.zeros(4, fmt.ELEMENT_DTYPE)
    records["img_num"] = 1
    records["flags"] = fmt.FLAG_SPLIT_START | fmt.FLAG_SPLIT_END
    first_unknown = len(fmt.KIND_NAMES)
    records["kind"] = [0, first_unknown, first_unknown + 5, first_unknown]
    assert element_problem(records, 1, 1) == f"unknown element kinds {[first_unknown, first_unknown + 5]}"


def test_split_flags_are_checked_per_view():
    flags = np.array([fmt.FLAG_SPLIT_START, fmt.FLAG_SPLIT_END, fmt.FLAG_SPLIT_START | fmt.FLAG_SPLIT_END], np.uint8)
    assert split_problem(flags, np.array([True, False, True])) is None
    assert split_problem(flags, np.array([True, True, False])) is not None  # view 1 starts without split_start


# ------------------------------------------------------------------ 6. verify tells the truth


def test_verify_probes_every_image_header_against_the_image_table(prefix):
    path = fmt.file_path(prefix, "plan")
    _overwrite(path, _array_offsets(path)["image_info"] + 4, (49).to_bytes(4, "little"))  # height 48 → 49
    _resign(prefix)
    assert verify(prefix) == [f"{prefix}.images: image 0 is a 64x48 PNG RGB image without transparency, but "
                              f"image_info in {prefix}.plan records 64x49 PNG RGB without transparency"]


def test_verify_refuses_the_transparency_bit_on_an_image_without_transparency(prefix):
    path = fmt.file_path(prefix, "plan")
    _overwrite(path, _array_offsets(path)["image_info"] + 10, bytes([fmt.IMAGE_FLAG_TRANSPARENCY]))
    _resign(prefix)
    assert verify(prefix) == [f"{prefix}.images: image 0 is a 64x48 PNG RGB image without transparency, but "
                              f"image_info in {prefix}.plan records 64x48 PNG RGB with transparency"]


@pytest.mark.parametrize(("offset", "value", "problem"), [(10, 2, "unknown image_info.flags bits"),
                                                          (10, 0x81, "unknown image_info.flags bits"),
                                                          (11, 1, "a nonzero image_info pad byte")])
def test_verify_and_the_pack_index_refuse_unknown_image_flag_bits_and_a_nonzero_pad(prefix, offset, value, problem):
    path = fmt.file_path(prefix, "plan")
    _overwrite(path, _array_offsets(path)["image_info"] + 12 + offset, bytes([value]))  # image 1
    _resign(prefix)
    assert verify(prefix) == [f"{prefix}.plan: images with {problem}"]
    with pytest.raises(FormatError, match=f"images with {problem}"):
        MMIDXDataset(prefix).check_structure()


def test_verify_refuses_sample_extra_that_is_not_a_json_object_as_sample_extra_does(tmp_path):
    with DatasetBuilder(tmp_path / "p", vocab_size=100) as builder:
        for n in range(3):
            builder.add_sample([[1, 2]], [], [[]], extra={"prompt_id": f"ab{n}"})
        builder.finalize()
    path = fmt.file_path(tmp_path / "p", "plan")
    start = int(MMIDXDataset(tmp_path / "p").plan["sample_extra_offsets"][1])
    _overwrite(path, _array_offsets(path)["sample_extra"] + start, b"[")  # sample 1's {"prompt_id": "ab1"}
    _resign(tmp_path / "p")
    (problem,) = verify(tmp_path / "p")
    assert problem.startswith(f"{tmp_path / 'p'}.plan: 1 samples' extra data is not a JSON object (first: sample 1, "
                              "not JSON (")
    with pytest.raises(FormatError, match=r"extra data of sample 1 is not JSON"):
        assert MMIDXDataset(tmp_path / "p")[1].extra is None


def test_verify_refuses_token_ids_beyond_the_recorded_vocabulary(prefix):
    largest = int(MMIDXDataset(prefix).tokens.tokens.max())
    _resign(prefix, lambda meta: meta.update(tokenizer={"name_or_path": "x", "vocab_size": largest}))
    assert verify(prefix) == [f"{prefix}.bin: token ids outside the tokenizer's vocabulary of {largest} (largest "
                              f"{largest}): the metadata's tokenizer.vocab_size is not the tokenizer's"]
    _resign(prefix, lambda meta: meta.update(tokenizer={"name_or_path": "x", "vocab_size": largest + 1}))
    assert verify(prefix) == []


@pytest.mark.parametrize("count", ["views", "elements", "images", "image_bytes"])
def test_metadata_counts_the_plan_disagrees_with_are_refused_naming_the_metadata_file(pack_setup, tmp_path, count):
    for role in ("idx", "bin", "images", "plan", "meta"):
        fmt.file_path(tmp_path / "t2i", role).write_bytes(fmt.file_path(pack_setup["t2i"]["datasets"][0],
                                                                        role).read_bytes())
    _resign(tmp_path / "t2i", lambda meta: meta["counts"].update({count: meta["counts"][count] + 1}))
    with pytest.raises(FormatError, match=f"^{re.escape(str(fmt.file_path(tmp_path / 't2i', 'meta')))}: the metadata "
                                          f"counts [0-9]+ {count}, the plan has [0-9]+$"):
        MMIDXDataset(tmp_path / "t2i")


def test_a_null_special_token_fails_verify_and_the_pack_builder_names_the_dataset(pack_setup, tmp_path):
    groups = {"t2i": dict(pack_setup["t2i"], datasets=[str(tmp_path / "t2i")])}
    for role in ("idx", "bin", "images", "plan", "meta"):
        source = fmt.file_path(pack_setup["t2i"]["datasets"][0], role)
        fmt.file_path(tmp_path / "t2i", role).write_bytes(source.read_bytes())
    _resign(tmp_path / "t2i", lambda meta: meta["special_tokens"].update(start_of_image=None))
    assert verify(tmp_path / "t2i") == [f"{tmp_path / 't2i'}.meta.json: special_tokens ['start_of_image'] are null: "
                                        "the packer cannot build a batch of this dataset (rebuild it with a tokenizer "
                                        "that has them)"]
    with pytest.raises(ValueError, match=rf"\['start_of_image'\] are unknown: {tmp_path / 't2i'} records none "
                                         r"\(null or missing in its metadata's special_tokens\): build the datasets "
                                         r"with mmidx's tokenizer or pass special_tokens"):
        PackBuilder(config_of(groups))


def test_verify_decode_decodes_every_image(tmp_path):
    data = bytearray(png_bytes(64, 48))
    data[-20] ^= 0xFF  # inside the compressed pixels: the header still probes
    from mmidx.sources.elements import Element, StoredImage

    with DatasetBuilder(tmp_path / "d", vocab_size=100, check_images=False) as builder:  # as if damaged later
        builder.add_sample([[1]], [StoredImage(bytes(data), 64, 48, "PNG", "RGB")], [[Element("vae_image", 0)]])
        builder.finalize()
    assert verify(tmp_path / "d") == []
    problems = verify(tmp_path / "d", decode=True)
    assert len(problems) == 1 and problems[0].startswith(f"{tmp_path / 'd'}.images: image 0: cannot decode")


def test_verify_of_a_megatron_pair_says_no_checksum_guards_it(tmp_path, capsys):
    fmt.write_token_index(tmp_path / "m.idx", np.dtype(np.uint16), np.array([3, 4]), np.array([0, 2]))
    (tmp_path / "m.bin").write_bytes(b"\x01" * 14)
    assert main(["verify", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "structure only" in out and "no checksum guards its bytes" in out and "checksums" not in out


@pytest.mark.timeout(900)  # over half the default: verify on every damaged file: 240 s at a load of 20
def test_verify_never_prints_a_traceback(prefix):
    meta = fmt.file_path(prefix, "meta")
    meta.write_bytes(b'{"format": "mmidx", "kind": 7}')  # not even valid for its checksum
    for args in (["verify", str(prefix)], ["verify", "--decode", str(prefix)], ["inspect", str(prefix)]):
        run = subprocess.run([sys.executable, "-m", "mmidx.cli", *args], capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and "Traceback" not in run.stderr and str(prefix) in run.stderr, run.stderr


def test_gpt_samples_of_a_dataset_without_tokens_name_the_dataset(tmp_path):
    with DatasetBuilder(tmp_path / "e", kind="text", vocab_size=100, special_tokens={"eod": 0}) as builder:
        builder.add_document([[]])
        builder.finalize()
    with pytest.raises(ValueError, match=rf"{tmp_path / 'e'}: the exposed documents hold 0 tokens"):
        GPTTextDataset(tmp_path / "e", seq_length=4)


def test_verify_reports_an_encodings_files_left_without_its_json(prefix):
    # a job configured to read encoding "x" fails to open it: verify says so rather than passing the dataset
    for role in ("bin", "idx"):
        fmt.encoding_path(prefix, "x", role).write_bytes(b"\0" * 16)
    assert verify(prefix) == [f"{prefix}.enc.x.json: missing beside the encoding's .bin/.idx: an interrupted "
                              "precache or a deleted file; run `mmidx precache` again"]


def test_relative_dataset_prefixes_of_a_config_are_named_as_written_not_joined_to_dot(prefix, monkeypatch):
    from mmidx.config import DataConfig

    monkeypatch.chdir(prefix.parent)
    config = DataConfig.from_dict({"groups": {"g": {"datasets": ["ds", "./ds", str(prefix)]}}})
    assert config.groups[0].datasets == ("ds", "./ds", str(prefix))
    assert DataConfig.from_dict({"groups": {"g": {"datasets": ["ds"]}}}, base_dir="/data").groups[0].datasets \
        == ("/data/ds",)


def _text_dataset(prefix, **special):
    with DatasetBuilder(prefix, kind="text", vocab_size=100,
                        special_tokens={"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3,
                                        "end_of_image": 4, **special}) as builder:
        for n in range(6):
            builder.add_document([[10 + n, 11, 12]])
        builder.finalize()
    return prefix


def test_a_text_dataset_without_image_ids_passes_verify_and_every_pack_of_it_builds(tmp_path):
    prefix = _text_dataset(tmp_path / "text", start_of_image=None, end_of_image=None)  # a text pack holds no image
    assert verify(prefix, decode=True) == []
    config = config_of({"text": {"datasets": [str(prefix)], "is_mandatory": True}})
    index = build_pack_index(config, cache_dir=None)
    builder = PackBuilder(config)  # the ids from the dataset, as a job takes them
    batches = [builder.build(pack, index.items(pack)) for pack in range(len(index))]
    assert len(batches) == len(index) >= 1
    assert sum(batch.sequence_length for batch in batches) == 6 * (3 + 2)  # each text framed by bos and eos


def test_a_text_dataset_with_a_null_bos_fails_verify_as_the_packer_refuses_it(tmp_path):
    prefix = _text_dataset(tmp_path / "text", bos_token_id=None)
    assert verify(prefix) == [f"{prefix}.meta.json: special_tokens ['bos_token_id'] are null: the packer cannot "
                              "build a batch of this dataset (rebuild it with a tokenizer that has them)"]
    with pytest.raises(ValueError, match=r"\['bos_token_id'\] are unknown"):
        PackBuilder(config_of({"text": {"datasets": [str(prefix)], "is_mandatory": True}}))
