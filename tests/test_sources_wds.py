"""wds: WebDataset tar shards grouped by key, captions from .txt and .json, built like t2i."""

import json

import pytest
from support.sources import build, encode, image_bytes, texts_of, write_tar

JPEG, PNG, WEBP = image_bytes(40, 30, seed=1), image_bytes(30, 20, "RGBA", "PNG", seed=2), \
    image_bytes(24, 24, "RGB", "WEBP", seed=3)
MEMBERS = [
    ("shard/000.jpg", JPEG), ("shard/000.txt", b"a red car\n"),
    ("shard/001.png", PNG), ("shard/001.json", json.dumps({"caption": "a blue house", "width": 30}).encode()),
    ("shard/002.webp", WEBP), ("shard/002.txt", b"a tree"), ("shard/002.json", b'{"caption": "a green tree"}'),
    ("shard/003.txt", b"caption without image"),
    ("shard/004.jpg", JPEG), ("shard/004.json", b'{"url": "http://x"}'),
    ("shard/005.jpg", JPEG), ("shard/005.txt", b""),
]


@pytest.fixture(scope="module")
def wds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wds")
    path = write_tar(folder / "00000.tar", MEMBERS)
    return build("wds", [path], folder / "out", views=3)


def test_samples_group_members_by_key_with_images_stored_as_given(wds):
    dataset, _ = wds
    assert [dataset[i].origin[1] for i in range(len(dataset))] == [0, 1, 2, 5]
    assert [bytes(dataset[i].image(0).data) for i in range(3)] == [JPEG, PNG, WEBP]


def test_captions_come_from_txt_and_the_json_caption_field(wds):
    dataset, _ = wds
    assert texts_of(dataset[0]) == [encode("a red car")]
    assert texts_of(dataset[1]) == [encode("a blue house")]
    assert sorted(texts_of(dataset[2])) == sorted([encode("a tree"), encode("a green tree")])


def test_an_empty_caption_becomes_bagels_single_space(wds):
    assert texts_of(wds[0][3]) == [encode(" ")]


def test_plans_are_t2i_plans_covering_the_captions(wds):
    sample = wds[0][2]
    plans = [sample.sequence_plan(v) for v in range(3)]
    assert all([(e["type"], e["loss"], e["enable_cfg"]) for e in plan] == [("text", 0, 1), ("vae_image", 1, 0)]
               for plan in plans)
    assert {plan[0]["payload"] for plan in plans[:2]} == {0, 1}


def test_samples_without_image_or_caption_are_skipped_with_their_reason(wds):
    _, report = wds
    skips = report.data["skips"]
    assert skips["missing_file"]["examples"][0]["row"] == 3
    assert skips["bad_captions"]["examples"][0]["row"] == 4


def test_a_truncated_tar_keeps_the_samples_before_the_damage(tmp_path):
    path = write_tar(tmp_path / "whole.tar", MEMBERS[:6])
    data = open(path, "rb").read()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2 + 700])
    dataset, report = build("wds", [tmp_path / "cut.tar"], tmp_path / "out")
    assert len(dataset) >= 1 and bytes(dataset[0].image(0).data) == JPEG
    assert report.data["skips"]["unreadable_file"]["count"] == 1
