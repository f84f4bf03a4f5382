"""Sharded datasets (format version 2): a table over shards reads every sample as the merge of the shards would,
checks what it maps, and a merge of it streams to the same bytes as the concatenated arrays written whole."""

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.helpers import assert_sample_equal, build, raw_samples, small_dataset

import mmidx.ingest.merge
import mmidx.sources.elements
from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.ingest.merge import merge_datasets
from mmidx.ingest.sharded import choose_layout, write_sharded
from mmidx.ingest.writer import DatasetBuilder
from mmidx.read.dataset import MMIDXDataset, WholeArraysError

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sharded(output: Path, parts: list[list], numbers: list[int] | None = None) -> MMIDXDataset:
    """The sharded dataset at ``output`` whose shards (folder numbers ``numbers``) hold ``parts``."""
    numbers = numbers if numbers is not None else list(range(len(parts)))
    for number, samples in zip(numbers, parts, strict=True):
        build(fmt.shard_prefix(output, number), samples, check_images=False)
    write_sharded(os.fspath(output), numbers, {"test": True})
    return MMIDXDataset(output)


def reference_files(prefixes: list[Path], folder: Path) -> dict[str, bytes]:
    """What a merge of ``prefixes`` must write: their arrays concatenated and shifted whole, written by the
    format's own whole-array writers (the straightforward computation the streaming merge replaces)."""
    datasets = [MMIDXDataset(prefix) for prefix in prefixes]
    lengths = np.concatenate([d.tokens.sequence_lengths for d in datasets])
    documents, base = [np.zeros(1, np.int64)], 0
    for d in datasets:
        documents.append(d.tokens.document_indices[1:].astype(np.int64) + base)
        base += d.tokens.sequence_count
    fmt.write_token_index(folder / "ref.idx", datasets[0].token_dtype, lengths, np.concatenate(documents))

    def joined(name):
        pieces, shift = [np.zeros(1, np.int64)], 0
        for d in datasets:
            pieces.append(d.plan[name][1:].astype(np.int64) + shift)
            shift += int(d.plan[name][-1])
        return np.concatenate(pieces)

    origins, sources = [], 0
    for d in datasets:
        origin = d.plan["sample_origin"].astype(np.int64)
        origin[:, 0] = np.where(origin[:, 0] >= 0, origin[:, 0] + sources, -1)
        origins.append(origin)
        sources += len(d.metadata["sources"])
    plan = {"sample_view_offsets": joined("sample_view_offsets"),
            "sample_image_offsets": joined("sample_image_offsets"),
            "sample_origin": np.concatenate(origins).reshape(-1, 2),
            "view_element_offsets": joined("view_element_offsets"),
            "elements": np.concatenate([d.plan["elements"] for d in datasets]),
            "image_offsets": joined("image_offsets"),
            "image_info": np.concatenate([d.plan["image_info"] for d in datasets])}
    if any("sample_extra" in d.plan for d in datasets):
        pieces, shift = [np.zeros(1, np.int64)], 0
        for d in datasets:
            offsets = d.plan.get("sample_extra_offsets", np.zeros(len(d) + 1, np.int64))
            pieces.append(offsets[1:].astype(np.int64) + shift)
            shift += int(offsets[-1])
        plan["sample_extra_offsets"] = np.concatenate(pieces)
        plan["sample_extra"] = np.concatenate([d.plan.get("sample_extra", np.zeros(0, np.uint8)) for d in datasets])
    fmt.write_plan(folder / "ref.plan", plan)
    return {"idx": (folder / "ref.idx").read_bytes(), "plan": (folder / "ref.plan").read_bytes(),
            "bin": b"".join(fmt.file_path(p, "bin").read_bytes() for p in prefixes),
            "images": b"".join(fmt.file_path(p, "images").read_bytes() for p in prefixes)}


@SETTINGS
@given(st.lists(st.lists(raw_samples(), max_size=4), min_size=1, max_size=5), st.integers(1, 4),
       st.randoms(use_true_random=False))
def test_a_sharded_dataset_reads_every_sample_and_merges_to_the_bytes_of_the_whole_arrays(parts, chunk, rng):
    numbers = sorted(rng.sample(range(40), len(parts)))  # folder numbers with gaps, as a build's empty units leave
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        dataset = sharded(Path(tmp) / "ds", parts, numbers)
        flat = [sample for samples in parts for sample in samples]
        assert len(dataset) == len(flat) == dataset.metadata["counts"]["samples"]
        assert dataset.is_sharded and [part.first_sample for part in dataset.parts] == \
            np.cumsum([0] + [len(p) for p in parts[:-1]]).tolist()
        again = pickle.loads(pickle.dumps(dataset))
        for i, raw in enumerate(flat):
            assert_sample_equal(dataset[i], raw)
            assert_sample_equal(again[i], raw)
        if flat:
            assert_sample_equal(dataset[-1], flat[-1])
        with pytest.raises(IndexError):
            dataset[len(flat)]
        patch.setattr(mmidx.ingest.merge, "CHUNK", chunk)  # chunk boundaries inside and across the shards
        merged = merge_datasets([Path(tmp) / "ds"], Path(tmp) / "merged")
        expected = reference_files([Path(fmt.shard_prefix(Path(tmp) / "ds", n)) for n in numbers], Path(tmp))
        for role, content in expected.items():
            assert fmt.file_path(merged, role).read_bytes() == content, role


def test_a_sharded_dataset_has_no_whole_arrays_and_says_what_to_do(tmp_path):
    dataset = sharded(tmp_path / "ds", [[], []])
    for name in ("tokens", "plan", "image_bytes", "remote_files"):
        with pytest.raises(WholeArraysError, match=r"sharded dataset \(2 shards\).*mmidx merge"):
            getattr(dataset, name)
    assert dataset.token_dtype == np.uint16 and dataset.kind == "multimodal"


def test_the_format_version_and_layout_say_sharded_and_an_older_reader_would_be_told_to_upgrade(tmp_path):
    small_dataset(tmp_path / "a")
    dataset = sharded(tmp_path / "ds", [[]])
    meta = dataset.metadata
    assert (meta["format_version"], meta["layout"], meta["shards"], set(meta["files"])) == (2, "sharded", 1, {"shards"})
    single = MMIDXDataset(tmp_path / "a").metadata
    assert single["format_version"] == 1 and "layout" not in single  # every earlier reader still opens these
    body = {key: value for key, value in meta.items() if key != "meta_sha256"}
    for change in ({"format_version": 1}, {"shards": 0}, {"layout": "tiled"}, {"files": {**meta["files"], "bin":
                                                                                             meta["files"]["shards"]}}):
        fmt.write_metadata(fmt.file_path(tmp_path / "ds", "meta"), {**body, **change})
        with pytest.raises(FormatError, match=r"ds\.meta\.json: metadata field"):
            MMIDXDataset(tmp_path / "ds")


@pytest.mark.parametrize("where", ["numbers", "offsets", "digest"])
def test_a_changed_table_is_refused_before_a_wrong_byte_is_read(tmp_path, where):
    parts = [small_dataset(tmp_path / "x", seed=s, count=2 + s) for s in range(3)]
    dataset = sharded(tmp_path / "ds", parts)
    table = fmt.file_path(tmp_path / "ds", "shards")
    arrays = fmt.read_shard_table(table, table.read_bytes(), dataset.metadata)
    numbers, offsets = arrays["shard_numbers"].copy(), arrays["shard_offsets"].copy()
    digests = [bytes(row).hex() for row in arrays["shard_meta_sha256"]]
    if where == "numbers":
        numbers[1] = 7
    elif where == "offsets":
        offsets[1, 0] += 1  # shard 0 would own a sample of shard 1
        offsets[1, 1] += 0
    else:
        digests[2] = "00" * 32
    fmt.write_shard_table(table, numbers, offsets, digests)
    meta = {key: value for key, value in dataset.metadata.items() if key != "meta_sha256"}
    meta["files"] = {"shards": {**meta["files"]["shards"], "bytes": table.stat().st_size,
                                fmt.FILE_HASH: fmt.hash_file(table)}}
    fmt.write_metadata(fmt.file_path(tmp_path / "ds", "meta"), meta)
    with pytest.raises(FormatError, match=r"ds"):
        reopened = MMIDXDataset(tmp_path / "ds")
        for i in range(len(reopened)):
            reopened[i].texts  # noqa: B018  (every sample read, or a FormatError first)


def test_a_shard_rebuilt_under_the_table_is_refused(tmp_path):
    dataset = sharded(tmp_path / "ds", [small_dataset(tmp_path / "x", seed=0), small_dataset(tmp_path / "y", seed=1)])
    small_dataset(fmt.shard_prefix(tmp_path / "ds", 1), seed=5)  # other content, same counts
    with pytest.raises(FormatError, match=r"not the .* it was opened as"):
        MMIDXDataset(tmp_path / "ds")[len(dataset) - 1]


def test_shards_must_share_kind_tokenizer_and_special_tokens(tmp_path):
    small_dataset(fmt.shard_prefix(tmp_path / "ds", 0))
    with DatasetBuilder(fmt.shard_prefix(tmp_path / "ds", 1), kind="text", vocab_size=1000) as builder:
        builder.add_document([[1, 2]])
        builder.finalize()
    with pytest.raises(ValueError, match="its kind"):
        write_sharded(os.fspath(tmp_path / "ds"), [0, 1], {})
    assert not fmt.file_path(tmp_path / "ds", "meta").exists()


def test_auto_layout_is_single_for_a_few_small_units_and_sharded_beyond(tmp_path):
    prefixes = []
    for k in range(fmt.AUTO_SINGLE_UNITS + 1):
        prefixes.append(fmt.shard_prefix(tmp_path / "ds", k))
        Path(prefixes[-1]).parent.mkdir(parents=True)
        fmt.file_path(prefixes[-1], "bin").write_bytes(b"12")
    assert choose_layout("auto", prefixes[:-1]) == "single"
    assert choose_layout("auto", prefixes) == "sharded"
    assert choose_layout("single", prefixes) == "single" and choose_layout("sharded", prefixes[:1]) == "sharded"
    with open(fmt.file_path(prefixes[0], "bin"), "r+b") as stream:
        stream.truncate(fmt.AUTO_SINGLE_BYTES + 1)  # sparse: large, without the disk
    assert choose_layout("auto", prefixes[:2]) == "sharded"


MANY = """
import os, resource, sys
from mmidx import format as fmt
from mmidx.ingest.merge import merge_datasets
from mmidx.ingest.sharded import write_sharded
from mmidx.read.dataset import MMIDXDataset
output, count = sys.argv[1], int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
write_sharded(output, list(range(count)), {{}})
dataset = MMIDXDataset(output)
texts = [dataset[i].texts[0].tolist() for i in range(len(dataset))]
merge_datasets([output], output + "-merged")
merged = MMIDXDataset(output + "-merged")
assert [merged[i].texts[0].tolist() for i in range(len(merged))] == texts
print(len(texts), len(os.listdir("/proc/self/fd")))
"""


def test_thousands_of_shards_open_read_and_merge_under_64_file_descriptors(tmp_path):
    """What failed at the end of builds past ~254 units ("Too many open files"): every shard mapped at once, each
    map holding a descriptor. Mapped files now hold none."""
    count = 1500
    for k in range(count):
        with DatasetBuilder(fmt.shard_prefix(tmp_path / "ds", k), vocab_size=1000) as builder:
            builder.add_sample([[k % 1000, 1]], [], [[mmidx.sources.elements.Element("text", 0, loss=True)]])
            builder.finalize()
    result = subprocess.run([sys.executable, "-c", MANY.format(), os.fspath(tmp_path / "ds"), str(count)],
                            capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-2000:]
    samples, descriptors = map(int, result.stdout.split())
    assert samples == count and descriptors < 64


def test_the_build_report_and_metadata_agree_on_the_counts(tmp_path):
    dataset = sharded(tmp_path / "ds", [small_dataset(tmp_path / "x", seed=s, count=2) for s in range(2)])
    counts = dataset.metadata["counts"]
    parts = [part.dataset.metadata["counts"] for part in dataset.parts]
    assert counts == {name: sum(part[name] for part in parts) for name in counts}
    assert json.loads(fmt.file_path(tmp_path / "ds", "meta").read_text())["shards"] == 2


def test_synthetic_sets_hold_the_same_samples_sharded_or_not_and_verify(tmp_path):
    from mmidx.read.checks import verify
    from mmidx.toolkit.scale_data import IMAGE_SIZES, write_synthetic

    single, shards = write_synthetic(tmp_path / "one", 3001), write_synthetic(tmp_path / "many", 3001, shards=13)
    one, many = MMIDXDataset(single), MMIDXDataset(shards)
    assert len(one) == len(many) == 3001 and len(many.parts) == 13
    for i in range(0, 3001, 7):
        assert one[i].texts[0].tolist() == many[i].texts[0].tolist() and 4 <= len(one[i].texts[0]) <= 12
        image = one[i].image(0)
        assert bytes(image.data) == bytes(many[i].image(0).data)
        assert (image.width, image.height) == IMAGE_SIZES[i % len(IMAGE_SIZES)]
    assert verify(single, decode=True) == []


def test_more_shards_than_stay_mapped_are_each_checked_once_and_remapped_when_evicted(tmp_path, monkeypatch):
    """The mapped limit unmaps shards, never the table that knows which shards were checked: each shard is
    checked once however often it is evicted (a sharded dataset evicted with its table re-checked every shard)."""
    from mmidx.read import mapped, shards
    from mmidx.toolkit.scale_data import write_synthetic

    prefix = write_synthetic(tmp_path / "t2i", 60, shards=12)
    whole = MMIDXDataset(write_synthetic(tmp_path / "one", 60))
    checked = []
    real = shards.ShardTable._checked
    monkeypatch.setattr(shards.ShardTable, "_checked", lambda self, shard: checked.append(shard) or real(self, shard))
    monkeypatch.setattr(mapped.MAPPED, "limit", 4)
    dataset = MMIDXDataset(prefix)
    for _ in range(3):
        for i in range(len(dataset)):
            mine, theirs = dataset[i], whole[i]
            assert [t.tolist() for t in mine.texts] == [t.tolist() for t in theirs.texts]
            assert [bytes(image.data) for image in mine.images] == [bytes(image.data) for image in theirs.images]
    assert sorted(checked) == list(range(12))
    assert len(mapped.MAPPED) <= 4


def test_metadata_bytes_that_passed_are_not_trusted_once_changed(tmp_path):
    small_dataset(tmp_path / "ds", seed=0)
    path = fmt.file_path(tmp_path / "ds", "meta")
    fmt.read_metadata(path)
    fmt.read_metadata(path)  # the same bytes: the same verdict
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"kind": "multimodal"', b'"kind": "multimodaX"'))
    with pytest.raises(FormatError, match="fails its own checksum"):
        fmt.read_metadata(path)


def test_the_default_mapped_limit_is_half_the_kernels_maps_at_four_a_dataset(tmp_path):
    from mmidx.read.mapped import default_limit

    (tmp_path / "maps").write_text("65530\n")
    assert default_limit(str(tmp_path / "maps")) == 8191  # 8,191 datasets of 4 maps: half of 65,530
    (tmp_path / "maps").write_text("262144\n")
    assert default_limit(str(tmp_path / "maps")) == 32768
    (tmp_path / "maps").write_text("1000\n")
    assert default_limit(str(tmp_path / "maps")) == 1024
    assert default_limit(str(tmp_path / "absent")) == 8191
