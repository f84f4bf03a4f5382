"""Building every group of a BAGEL data YAML in one command, and the data.yaml it writes."""

import json
import os
import re

import pyarrow as pa
import pytest
import yaml
from support.sources import image_bytes, tokenizer_dir, write_jsonl, write_mp4, write_parquet

from mmidx import cli
from mmidx.read.dataset import MMIDXDataset

BAGEL_CONFIG = """
t2i_pretrain:
  dataset_names:
  - t2i
  image_transform_args:
    image_stride: 16
    max_image_size: 1024
    min_image_size: 512
  is_mandatory: true
  num_used_data:
  - 10
  weight: 1

unified_edit:
  dataset_names:
  - seedxedit_multi
  image_transform_args:
    image_stride: 16
    max_image_size: 1024
    min_image_size: 512
  vit_image_transform_args:
    image_stride: 14
    max_image_size: 518
    min_image_size: 224
  is_mandatory: false
  num_used_data:
  - 10
  weight: 1

vlm_sft:
  dataset_names:
  - llava_ov
  image_transform_args:
    image_stride: 14
    max_image_size: 980
    min_image_size: 378
    max_pixels: 2_007_040
  frame_sampler_args:
    max_num_frames: 3
    min_num_frames: 2
  is_mandatory: true
  shuffle_lines: True
  shuffle_seed: 0
  num_used_data:
  - 1000
  weight: 0.5
"""


@pytest.fixture
def bagel_data(tmp_path):
    root = tmp_path / "bagel_example"
    (root / "t2i").mkdir(parents=True)
    (root / "editing" / "seedxedit_multi").mkdir(parents=True)
    (root / "vlm" / "images").mkdir(parents=True)
    for f in range(2):
        write_parquet(root / "t2i" / f"chunk_{f}.parquet",
                      {"image": [image_bytes(32, 32, seed=10 * f + i) for i in range(3)],
                       "captions": [json.dumps({"0": f"caption {f} {i}"}) for i in range(3)]},
                      {"image": pa.binary(), "captions": pa.string()}, row_group_size=2)
    write_parquet(root / "editing" / "seedxedit_multi" / "chunk_0.parquet",
                  {"image_list": [[image_bytes(16, 16, seed=k) for k in range(3)]],
                   "instruction_list": [[["make it red"], ["add a hat"]]]},
                  {"image_list": pa.list_(pa.binary()), "instruction_list": pa.list_(pa.list_(pa.string()))}, 10)
    (root / "vlm" / "images" / "img_0.jpg").write_bytes(image_bytes(40, 40, seed=3))
    write_mp4(root / "vlm" / "images" / "clip.mp4", 20)
    write_jsonl(root / "vlm" / "llava_ov_si.jsonl", [
        {"image": "img_0.jpg", "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                 {"from": "gpt", "value": "A picture."}]},
        {"video": "clip.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                                                {"from": "gpt", "value": "Colours."}]}])
    info = {"t2i_pretrain": {"t2i": {"data_dir": "bagel_example/t2i", "num_files": 10}},
            "unified_edit": {"seedxedit_multi": {"data_dir": "bagel_example/editing/seedxedit_multi",
                                                 "parquet_info_path": "unused.json"}},
            "vlm_sft": {"llava_ov": {"data_dir": "bagel_example/vlm/images",
                                     "jsonl_path": "bagel_example/vlm/llava_ov_si.jsonl"}}}
    (tmp_path / "info.yaml").write_text(yaml.safe_dump(info))
    (tmp_path / "bagel.yaml").write_text(BAGEL_CONFIG)
    return tmp_path


def _build(folder, *extra):
    return cli.main(["build", "--config", str(folder / "bagel.yaml"), "--dataset-info", str(folder / "info.yaml"),
                     "--tokenizer", tokenizer_dir(), "--output-dir", str(folder / "out"), "--quiet", *extra])


def test_data_yaml_lists_every_group_with_its_datasets_weights_and_transforms(bagel_data):
    assert _build(bagel_data) == 0
    config = yaml.safe_load((bagel_data / "out" / "data.yaml").read_text())
    assert config == {"groups": {
        "t2i_pretrain": {"datasets": ["t2i_pretrain/t2i"], "weight": 1.0, "is_mandatory": True,
                         "image_transform_args": {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512},
                         "num_used_data": [10]},
        "unified_edit": {"datasets": ["unified_edit/seedxedit_multi"], "weight": 1.0, "is_mandatory": False,
                         "image_transform_args": {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512},
                         "vit_image_transform_args": {"image_stride": 14, "max_image_size": 518,
                                                      "min_image_size": 224}, "num_used_data": [10]},
        "vlm_sft": {"datasets": ["vlm_sft/llava_ov"], "weight": 0.5, "is_mandatory": True,
                    "image_transform_args": {"image_stride": 14, "max_image_size": 980, "min_image_size": 378,
                                             "max_pixels": 2007040},
                    "num_used_data": [1000], "shuffle_lines": True, "shuffle_seed": 0}}}


def test_each_dataset_is_built_from_its_dataset_info_entry(bagel_data):
    assert _build(bagel_data) == 0
    folder = bagel_data / "out"
    config = yaml.safe_load((folder / "data.yaml").read_text())
    opened = {group: [MMIDXDataset(os.path.join(folder, prefix)) for prefix in spec["datasets"]]
              for group, spec in config["groups"].items()}
    assert len(opened["t2i_pretrain"][0]) == 6
    assert len(opened["unified_edit"][0]) == 1
    vlm = opened["vlm_sft"][0]
    assert vlm[0].num_images == 1
    frames = [e for e in vlm[1].sequence_plan(0) if e["type"] == "vit_image"]
    assert 2 <= len(frames) <= 3  # frame_sampler_args of the config


def test_a_rerun_says_each_dataset_was_built_earlier_rather_than_timing_it_again(bagel_data, capsys):
    assert _build(bagel_data) == 0
    first = [line for line in capsys.readouterr().out.splitlines() if re.search(r" from [\d,]+ rows? ", line)]
    assert _build(bagel_data) == 0
    again = capsys.readouterr().out.splitlines()
    rerun = [line for line in again if re.search(r" from [\d,]+ rows? ", line)]
    assert len(rerun) == len(first) == 3
    for before, after in zip(first, rerun, strict=True):  # the earlier build's time, said to be the earlier one's
        assert before.split(" in ", 1)[1] == after.split(" built earlier in ", 1)[1]
    assert sum(line.startswith("OK: already built") for line in again) == 3


def test_an_unknown_group_type_is_refused_by_name(bagel_data, capsys):
    (bagel_data / "bagel.yaml").write_text(BAGEL_CONFIG + "\ninterleaved_video:\n  dataset_names: [x]\n")
    assert _build(bagel_data) == 1
    assert "interleaved_video" in capsys.readouterr().err


def test_no_data_yaml_is_written_when_a_build_fails(bagel_data):
    write_jsonl(bagel_data / "bagel_example" / "vlm" / "llava_ov_si.jsonl", ["not json"])
    assert _build(bagel_data) == 1
    assert not (bagel_data / "out" / "data.yaml").exists()


def test_mixing_single_source_and_config_arguments_is_refused(bagel_data, capsys):
    with pytest.raises(SystemExit) as exit:
        _build(bagel_data, "--source", "t2i")
    assert exit.value.code == 2
    assert "either --source, --input and --output, or --config" in capsys.readouterr().err


def test_frame_sampler_args_choose_the_sampling_mode(bagel_data):
    (bagel_data / "bagel.yaml").write_text(BAGEL_CONFIG.replace("    min_num_frames: 2", "    min_num_frames: 3\n"
                                                                "    sample: middle"))
    assert _build(bagel_data) == 0
    vlm = MMIDXDataset(bagel_data / "out" / "vlm_sft" / "llava_ov")
    numbers = vlm[1].extra["video_frames"]
    drawn = [numbers[e["payload"]] for e in vlm[1].sequence_plan(0) if e["type"] == "vit_image"]
    assert drawn == [2, 9, 16]  # intervals [0, 6) [6, 13) [13, 20) of 20 frames: (a + b - 1) // 2


def test_unknown_group_and_frame_sampler_keys_are_refused_before_building(bagel_data, capsys):
    (bagel_data / "bagel.yaml").write_text(BAGEL_CONFIG.replace("  shuffle_seed: 0", "  shuffle_sed: 0"))
    assert _build(bagel_data) == 1
    assert "unknown keys ['shuffle_sed']" in capsys.readouterr().err
    assert not (bagel_data / "out").exists()
    (bagel_data / "bagel.yaml").write_text(BAGEL_CONFIG.replace("    min_num_frames: 2", "    min_frames: 2"))
    assert _build(bagel_data) == 1
    assert "unknown keys ['min_frames']; the known ones are min_num_frames" in capsys.readouterr().err


def test_video_frame_quality_stores_jpeg_frames(bagel_data):
    assert _build(bagel_data, "--video-frame-quality", "90") == 0
    vlm = MMIDXDataset(bagel_data / "out" / "vlm_sft" / "llava_ov")
    assert {image.format for image in vlm[1].images} == {"JPEG"}
