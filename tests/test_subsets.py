"""BAGEL's data config knobs (num_used_data, shuffle_lines, shuffle_seed) select the samples BAGEL would use."""

import json
import random

import pyarrow as pa
import pytest
from support.sources import build, image_bytes, write_jsonl, write_parquet

from mmidx.config import DataConfig, data_yaml_group
from mmidx.index.mixture import mixture_report
from mmidx.index.pack_index import build_pack_index
from mmidx.index.sizes import view_token_counts
from mmidx.read.dataset import MMIDXDataset

VLM = {"image_stride": 14, "max_image_size": 140, "min_image_size": 56}
VAE = {"image_stride": 16, "max_image_size": 64, "min_image_size": 32}
VIT = {"image_stride": 14, "max_image_size": 56, "min_image_size": 28}
PACKING = {"max_num_tokens": 4000, "expected_num_tokens": 3000, "max_num_tokens_per_sample": 2000}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A conversation JSONL with a blank and a broken line among 30 usable ones, built into a dataset."""
    folder = tmp_path_factory.mktemp("vlm")
    rows = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}
            for i in range(30)]
    rows[7:7] = [""]
    rows[12:12] = ["{not json"]
    path = write_jsonl(folder / "chat.jsonl", rows)
    dataset, _ = build("vlm", [path], folder / "vlm")
    return path, dataset.prefix


def used_lines(path, prefix, **knobs):
    """The JSONL lines the packs of one epoch's stream draw from, as text."""
    config = DataConfig.from_dict({"groups": {"vlm": {"datasets": [prefix], "image_transform_args": VLM, **knobs}},
                                   "packing": PACKING})
    index = build_pack_index(config, num_samples=400)
    with open(path) as stream:
        lines = stream.readlines()
    dataset = MMIDXDataset(prefix)
    return {lines[dataset[item.sample].origin[1]] for pack in range(len(index)) for item in index.items(pack)}


def bagel_lines(path, num_used_data, shuffle_lines, shuffle_seed):
    """SftJSONLIterableDataset.get_data_paths, restated; lines that are not conversations are dropped later."""
    with open(path) as stream:
        raw_data = stream.readlines()
    if shuffle_lines:
        rng = random.Random()
        rng.seed(shuffle_seed)
        rng.shuffle(raw_data)
    return {line for line in raw_data[:num_used_data] if line.startswith('{"conversations"')}


@pytest.mark.parametrize(("count", "shuffle", "seed"), [(10, True, 0), (10, True, 3), (10, False, 0), (50, True, 1)])
def test_vlm_lines_are_bagels_shuffled_subset(vlm, count, shuffle, seed):
    path, prefix = vlm
    expected = bagel_lines(path, count, shuffle, seed)
    assert used_lines(path, prefix, num_used_data=[count], shuffle_lines=shuffle, shuffle_seed=seed) == expected


def test_without_knobs_every_line_is_used(vlm):
    path, prefix = vlm
    assert used_lines(path, prefix) == bagel_lines(path, None, False, 0)


@pytest.fixture(scope="module")
def t2i(tmp_path_factory):
    """Three parquet files of two rows each; every row's caption names its file."""
    folder = tmp_path_factory.mktemp("t2i")
    for number in range(3):
        write_parquet(folder / f"part-{number}.parquet",
                      {"image": [image_bytes(32, 32, seed=row) for row in range(2)],
                       "captions": [json.dumps({"0": f"file {number}"})] * 2},
                      {"image": pa.binary(), "captions": pa.string()}, row_group_size=2)
    dataset, _ = build("t2i", [folder], folder / "t2i", views=1)
    return dataset


@pytest.fixture(scope="module")
def edit(tmp_path_factory):
    """Three parquet files of two edits each (two images, one instruction); every instruction names its file."""
    folder = tmp_path_factory.mktemp("edit")
    for number in range(3):
        write_parquet(folder / f"part-{number}.parquet",
                      {"image_list": [[image_bytes(32, 32, seed=2 * number + row), image_bytes(32, 32, seed=9)]
                                      for row in range(2)],
                       "instruction_list": [[[f"file {number}"]]] * 2},
                      {"image_list": pa.list_(pa.binary()), "instruction_list": pa.list_(pa.list_(pa.string()))},
                      row_group_size=2)
    dataset, _ = build("edit", [folder], folder / "edit", views=1)
    return dataset


def bagel_parquet_files(names, num_used_data):
    """get_parquet_data_paths for one folder, restated (in name order instead of os.listdir's)."""
    repeat = num_used_data // len(names)
    return (names * (repeat + 1))[:num_used_data]


@pytest.mark.parametrize("source", ["t2i", "edit"])  # BAGEL's t2i_pretrain and unified_edit list files alike
@pytest.mark.parametrize("count", [2, 5])
def test_parquet_files_are_bagels_cycled_list(request, source, count):
    dataset = request.getfixturevalue(source)
    transforms = {"image_transform_args": VAE} | ({"vit_image_transform_args": VIT} if source == "edit" else {})
    config = DataConfig.from_dict({"groups": {source: {"datasets": [dataset.prefix], **transforms,
                                                       "num_used_data": [count]}}, "packing": PACKING})
    index = build_pack_index(config)
    names = sorted(dataset.metadata["sources"])
    expected = bagel_parquet_files(names, count)
    assert index.stats["samples"] == 2 * len(expected)  # one epoch: every used sample once per listing
    drawn = [dataset[item.sample].origin[0] for pack in range(len(index)) for item in index.items(pack)]
    assert sorted(drawn) == sorted(name for name in expected for _ in range(2))


def test_the_mixture_report_counts_the_tokens_of_the_samples_a_subset_uses(t2i):
    """Five files of three used (cycled): the index's samples number the used ones, ten of the dataset's six."""
    config = DataConfig.from_dict({"groups": {"t2i": {"datasets": [t2i.prefix], "image_transform_args": VAE,
                                                      "num_used_data": [5]}}, "packing": PACKING})
    index = build_pack_index(config)
    offsets, tokens = view_token_counts(t2i, config.groups[0], config.geometry)
    packed = [int(tokens[offsets[item.sample] + item.view]) for pack in range(len(index)) for item in index.items(pack)]
    assert len(packed) == 10
    assert mixture_report(index)["phases"][0]["groups"]["t2i"] == {"samples": 10, "tokens": sum(packed),
                                                                   "share": 1.0, "weight": 1.0}


def test_shuffle_lines_on_a_parquet_dataset_is_refused(t2i):
    config = DataConfig.from_dict({"groups": {"t2i": {"datasets": [t2i.prefix], "image_transform_args": VAE,
                                                      "shuffle_lines": True}}})
    with pytest.raises(ValueError, match="shuffle_lines applies to vlm datasets only"):
        build_pack_index(config)


def test_unknown_group_keys_are_refused_naming_them_and_resume_data_status_is_noted():
    spec = {"datasets": ["x"], "resume_data_status": False}
    with pytest.warns(UserWarning, match="resume_data_status is ignored: mmidx resumes from the loader's packs"):
        DataConfig.from_dict({"groups": {"g": spec}})
    with pytest.raises(ValueError, match=r"group 'g': unknown keys \['num_used_datas'\]"):
        DataConfig.from_dict({"groups": {"g": {"datasets": ["x"], "num_used_datas": [3]}}})
    with pytest.raises(ValueError, match="one positive count per dataset"):
        DataConfig.from_dict({"groups": {"g": {"datasets": ["x", "y"], "num_used_data": [3]}}})


def test_a_bagel_group_becomes_a_data_yaml_group_with_its_knobs():
    spec = {"dataset_names": ["llava"], "weight": 2, "is_mandatory": True, "image_transform_args": VLM,
            "frame_sampler_args": {"max_num_frames": 12}, "shuffle_lines": True, "shuffle_seed": 4,
            "num_used_data": [100]}
    entry = data_yaml_group("vlm_sft", spec, ["vlm_sft/llava"])
    assert entry == {"datasets": ["vlm_sft/llava"], "weight": 2.0, "is_mandatory": True, "image_transform_args": VLM,
                     "num_used_data": [100], "shuffle_lines": True, "shuffle_seed": 4}
    group = DataConfig.from_dict({"groups": {"vlm_sft": entry}}).groups[0]
    assert (group.num_used_data, group.shuffle_lines, group.shuffle_seed) == ((100,), True, 4)
    with pytest.raises(ValueError, match=r"unknown keys \['dataset_name'\]"):
        data_yaml_group("vlm_sft", {"dataset_name": ["llava"]}, [])
