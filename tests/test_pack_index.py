"""The pack index: exact per-view sizes, whole samples in budget, a cache keyed by what it depends on."""

import json

import numpy as np
import pytest
from support.packing import PACKING, build_groups, config_of
from tqdm import tqdm

import mmidx.index.pack_index
from mmidx.format import FormatError
from mmidx.index.pack_index import PackItem, build_pack_index
from mmidx.index.packer import pack_samples
from mmidx.index.sizes import view_table, view_token_counts
from mmidx.index.stream import multimodal_stream, stream_views
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return build_groups(tmp_path_factory.mktemp("index"))


def test_view_sizes_equal_the_length_of_the_packed_sample(groups):
    config = config_of(groups)
    builder = PackBuilder(config)
    for g, group in enumerate(config.groups):
        dataset = MMIDXDataset(group.datasets[0])
        view_offsets, view_tokens = view_token_counts(dataset, group, config.geometry)
        for sample in range(len(dataset)):
            for view in range(dataset[sample].num_views):
                batch = builder.build(0, [PackItem(g, 0, sample, view)])
                assert batch.sequence_length == view_tokens[view_offsets[sample] + view]


def test_a_groups_second_dataset_has_its_views_after_the_firsts(groups):
    config = config_of(groups)
    datasets = [[MMIDXDataset(group.datasets[0])] for group in config.groups]
    first = datasets[0][0]
    offsets, tokens = view_token_counts(first, config.groups[0], config.geometry)
    table = view_table(config, [[first, first], *datasets[1:]])  # group 0: the same dataset twice, end to end
    views = int(offsets[-1])
    np.testing.assert_array_equal(table.view_offsets[:2 * len(first) + 1], np.r_[offsets, offsets[1:] + views])
    np.testing.assert_array_equal(table.view_tokens[:2 * views], np.r_[tokens, tokens])


def test_a_batch_asked_for_a_tensor_it_lacks_names_it_and_the_present_ones(groups):
    batch = PackBuilder(config_of(groups)).build(0, [PackItem(0, 0, 0, 0)])
    with pytest.raises(AttributeError,
                       match=r"^PackedBatch has no 'packed_text_idz' \(present keys: \[.*'packed_text_ids'"):
        batch.packed_text_idz  # noqa: B018 (the attribute access is the test)


def test_an_index_shows_its_packs_in_the_singular_only_for_one(groups):
    one, many = (build_pack_index(config_of(groups), num_samples=n) for n in (1, 60))
    assert len(one) == 1 and len(many) > 1
    assert repr(one).startswith("PackIndex(1 pack, 1 items, groups ") and repr(one).endswith(", in memory)")
    assert repr(many).startswith(f"PackIndex({len(many)} packs, 60 items, groups ")


def test_an_index_keeps_the_views_of_its_items_only_when_a_sample_has_more_than_one(groups):
    assert {MMIDXDataset(groups["t2i"]["datasets"][0])[0].num_views,
            MMIDXDataset(groups["vlm"]["datasets"][0])[0].num_views} == {2, 1}
    assert "views" in build_pack_index(config_of({"t2i": groups["t2i"]}), num_samples=10).arrays
    assert "views" not in build_pack_index(config_of({"vlm": groups["vlm"]}), num_samples=10).arrays  # all view 0


def whole_array_packs(config, num_samples):
    """The reference: the whole stream, its views and its packs built in memory at once."""
    datasets = [[MMIDXDataset(p) for p in g.datasets] for g in config.groups]
    table = view_table(config, datasets)
    sizes = np.diff(table.group_base)
    groups, samples, epochs = multimodal_stream(sizes, [g.weight for g in config.groups], num_samples, config.seed)
    offsets, tokens = [], []
    for g in range(len(sizes)):
        first, last = table.view_offsets[table.group_base[g]], table.view_offsets[table.group_base[g + 1]]
        offsets.append(table.view_offsets[table.group_base[g]:table.group_base[g + 1] + 1] - first)
        tokens.append(table.view_tokens[first:last])
    views, counts = stream_views(groups, samples, epochs, offsets, tokens)
    packed = pack_samples(counts, groups, mandatory=[g.is_mandatory for g in config.groups],
                          **{k: getattr(config.packing, k) for k in PACKING})
    return packed, table.group_base[groups] + samples, views, counts


@pytest.mark.parametrize("chunk_size", [1, 7, 1 << 20])
def test_streamed_index_equals_the_whole_array_build(groups, tmp_path, chunk_size):
    config = config_of(groups)
    index = build_pack_index(config, num_samples=60, cache_dir=tmp_path, chunk_size=chunk_size)
    packed, numbers, views, counts = whole_array_packs(config, 60)
    np.testing.assert_array_equal(index.arrays["pack_offsets"], packed.pack_offsets)
    np.testing.assert_array_equal(index.arrays["samples"], numbers[packed.pack_items])
    np.testing.assert_array_equal(index.arrays["views"], views[packed.pack_items])
    assert index.stats["num_packs"] == len(index) == len(packed)
    assert index.stats["excluded"] == len(packed.excluded)
    assert sum(index.stats["groups"].values()) == 60
    for k in range(len(index)):
        assert counts[packed.pack(k)].sum() <= PACKING["max_num_tokens"]


def test_mandatory_group_starts_every_pack(groups, tmp_path):
    index = build_pack_index(config_of(groups), num_samples=60)
    mandatory = [g for g, group in enumerate(index.config.groups) if group.is_mandatory]
    assert mandatory == [0]
    starts = [index.items(k)[0].group for k in range(len(index) - 1)]
    assert all(group == 0 for group in starts)


def test_cache_is_reused_and_keyed_by_config(groups, tmp_path, capsys):
    first = build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path)
    again = build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path)
    assert (first.reused, again.reused) == (False, True)
    assert capsys.readouterr().err.splitlines() == [f"mmidx: pack index reused from {first.path}"]
    assert again.path == first.path and isinstance(again.arrays["samples"], np.memmap)
    assert first.arrays.keys() == again.arrays.keys()
    assert all(np.array_equal(first.arrays[k], again.arrays[k]) for k in first.arrays)
    other_seed = build_pack_index(config_of(groups, seed=1), num_samples=40, cache_dir=tmp_path)
    longer = build_pack_index(config_of(groups), num_samples=41, cache_dir=tmp_path)
    assert len({first.path, other_seed.path, longer.path}) == 3
    assert not list(tmp_path.glob("*.partial-*"))


def test_a_build_shows_its_progress_bar_unless_asked_not_to(groups, capsys, monkeypatch):
    """The bar shows once a build has run 2 s (a quick one prints nothing); here at once, to see it."""
    monkeypatch.setattr(mmidx.index.pack_index, "tqdm", lambda *args, **kwargs: tqdm(*args, **{**kwargs, "delay": 0}))
    build_pack_index(config_of(groups), num_samples=40)
    assert "building pack index" in capsys.readouterr().err
    build_pack_index(config_of(groups), num_samples=40, progress=False)
    assert capsys.readouterr().err == ""


def test_cache_holds_narrow_arrays_described_in_its_index(groups, tmp_path):
    index = build_pack_index(config_of(groups), num_samples=300, cache_dir=tmp_path)
    described = json.loads((index.path / "index.json").read_text())
    # 12 samples in all, at most 2 views a sample, 300 stream items: one byte, one byte, two bytes.
    assert {k: v["dtype"] for k, v in described["arrays"].items()} == \
        {"samples": "|u1", "views": "|u1", "pack_offsets": "<u2"}
    assert sorted(p.name for p in index.path.iterdir()) == ["index.json", "pack_offsets.bin", "samples.bin",
                                                           "views.bin"]
    size = sum(p.stat().st_size for p in index.path.glob("*.bin"))
    assert size == 2 * 300 + 2 * (len(index) + 1) - index.stats["excluded"] * 2


def test_a_build_that_fails_leaves_nothing_that_loads(groups, tmp_path, monkeypatch):
    import mmidx.index.pack_index

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mmidx.index.pack_index, "write_pack_index", fail)
    with pytest.raises(KeyboardInterrupt):
        build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    # What a killed build leaves (a partial folder, arrays without index.json) is never loaded.
    monkeypatch.undo()
    folder = build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path).path
    folder.rename(folder.with_name(f"{folder.name}.partial-12345"))
    (folder.with_name(f"{folder.name}.partial-12345") / "index.json").unlink()
    assert not build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path).reused


def test_a_truncated_cache_file_is_a_format_error(groups, tmp_path):
    index = build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path)
    samples = index.path / "samples.bin"
    samples.write_bytes(samples.read_bytes()[:-1])
    with pytest.raises(FormatError, match=r"samples\.bin"):
        build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path)


def test_items_name_views_that_exist(groups):
    index = build_pack_index(config_of(groups), num_samples=80)
    for k in range(len(index)):
        for item in index.items(k):
            sample = MMIDXDataset(index.config.groups[item.group].datasets[item.dataset])[item.sample]
            assert 0 <= item.view < sample.num_views


def test_items_decode_the_pack_arrays(groups):
    index = build_pack_index(config_of(groups), num_samples=80)
    # Sample numbers run over every dataset of every group in config order: spell that out by hand.
    owners = [(g, d, s) for g, group in enumerate(index.config.groups) for d, prefix in enumerate(group.datasets)
              for s in range(len(MMIDXDataset(prefix)))]
    offsets, numbers, views = (np.asarray(index.arrays[k]).tolist() for k in ("pack_offsets", "samples", "views"))
    for k in range(len(index)):
        expected = [PackItem(*owners[numbers[i]], views[i]) for i in range(offsets[k], offsets[k + 1])]
        assert index.items(k) == expected


def test_pack_arrays_naming_items_or_samples_beyond_the_index_are_format_errors(groups, tmp_path):
    index = build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path)
    samples = index.path / "samples.bin"
    good = samples.read_bytes()
    samples.write_bytes(b"\xff" * len(good))
    with pytest.raises(FormatError, match="beyond the datasets"):
        build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path).items(0)
    samples.write_bytes(good)
    offsets = index.path / "pack_offsets.bin"  # one byte an offset here: pack 0 ends at 255
    offsets.write_bytes(offsets.read_bytes()[:1] + b"\xff" * (offsets.stat().st_size - 1))
    with pytest.raises(FormatError, match="spans items"):
        build_pack_index(config_of(groups), num_samples=40, cache_dir=tmp_path).items(0)


def test_index_command_says_whether_it_built_or_reused_the_cache(groups, tmp_path, capsys):
    from mmidx.cli import main

    prefixes = [group["datasets"][0] for group in groups.values()]
    for word in ("built", "reused"):
        assert main(["index", *prefixes, "--num-samples", "50", "--max-latent-size", "64",
                     "--cache-dir", str(tmp_path)]) == 0
        assert capsys.readouterr().out.splitlines()[0].endswith(f"({word})")
