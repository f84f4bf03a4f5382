"""t2i: captions stored once and covered by the views, caption → noised-VAE plans, images stored as given."""

import io
from collections import Counter

import pytest
from PIL import Image
from support.cases import CAPTIONS, IMAGES
from support.sources import build, encode, image_bytes, texts_of, write_t2i_parquet

VIEWS = 5


@pytest.fixture(scope="module")
def t2i(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t2i")
    images = [image_bytes(w, h, mode, fmt, seed=i) for i, (w, h, mode, fmt) in enumerate(IMAGES)]
    path = write_t2i_parquet(folder / "part.parquet", images, CAPTIONS, row_group_size=3)
    dataset, report = build("t2i", [path], folder / "out", views=VIEWS, rows_per_shard=2)
    return dataset, report, images, path


def _caption_of_view(sample, view):
    text, _image = sample.sequence_plan(view)
    return sample.text(text["payload"]).tolist()


def test_every_row_is_a_sample_in_input_order(t2i):
    dataset, report, _, path = t2i
    assert report.data["units"] == 3  # three row groups of 3, 3 and 1 rows
    assert [dataset[i].origin for i in range(len(dataset))] == [(path, row) for row in range(len(CAPTIONS))]


def test_each_distinct_caption_is_stored_once(t2i):
    dataset = t2i[0]
    for i, captions in enumerate(CAPTIONS):
        expected = [encode(text) for text in dict.fromkeys(captions.values())] or [encode(" ")]
        assert sorted(texts_of(dataset[i])) == sorted(expected)


def test_views_cover_all_captions_before_repeating_any(t2i):
    dataset = t2i[0]
    for i in range(len(dataset)):
        sample = dataset[i]
        shown = [tuple(_caption_of_view(sample, v)) for v in range(sample.num_views)]
        distinct = sample.num_texts
        assert len(shown) == VIEWS
        assert len(set(shown[:distinct])) == min(distinct, VIEWS)
        counts = Counter(shown).values()
        assert max(counts) - min(counts) <= 1 and len(counts) == min(distinct, VIEWS)


def test_empty_caption_object_gives_the_single_caption_space(t2i):
    sample = t2i[0][2]
    assert texts_of(sample) == [encode(" ")]
    assert all(_caption_of_view(sample, v) == encode(" ") for v in range(VIEWS))


def test_plan_is_caption_with_cfg_then_noised_vae_of_the_one_image(t2i):
    dataset = t2i[0]
    for i in range(len(dataset)):
        for view in range(VIEWS):
            text, image = dataset[i].sequence_plan(view)
            assert (text["type"], text["loss"], text["enable_cfg"]) == ("text", 0, 1)
            assert (image["type"], image["loss"], image["enable_cfg"], image["payload"]) == ("vae_image", 1, 0, 0)
            assert image["img_num"] == 1


def test_images_are_stored_byte_identical_with_their_probed_size_mode_and_format(t2i):
    dataset, _, images, _ = t2i
    for i, data in enumerate(images):
        sample = dataset[i]
        assert sample.num_images == 1
        stored = sample.image(0)
        assert bytes(stored.data) == data
        pil = Image.open(io.BytesIO(data))
        assert (stored.width, stored.height, stored.mode, stored.format) == (*pil.size, pil.mode, pil.format)


def test_rgba_images_record_their_transparency(t2i):
    dataset = t2i[0]
    assert [dataset[i].image(0).has_transparency for i in range(len(IMAGES))] == \
        [mode == "RGBA" for _, _, mode, _ in IMAGES]


def test_the_same_seed_draws_the_same_views_and_another_seed_others(t2i, tmp_path):
    dataset, _, _, path = t2i
    again, _ = build("t2i", [path], tmp_path / "again", views=VIEWS)
    other, _ = build("t2i", [path], tmp_path / "other", views=VIEWS, seed=1)

    def plans(ds):
        return [[ds[i].sequence_plan(v) for v in range(VIEWS)] for i in range(len(ds))]

    assert plans(again) == plans(dataset)
    assert plans(other) != plans(dataset)


def test_a_file_uri_input_builds_the_same_samples(t2i, tmp_path):
    dataset, _, _, path = t2i
    via_uri, _ = build("t2i", [f"file://{path}"], tmp_path / "uri", views=VIEWS)
    assert len(via_uri) == len(dataset)
    for i in range(len(dataset)):
        assert texts_of(via_uri[i]) == texts_of(dataset[i])
        assert bytes(via_uri[i].image(0).data) == bytes(dataset[i].image(0).data)
        assert [via_uri[i].sequence_plan(v) for v in range(VIEWS)] == \
            [dataset[i].sequence_plan(v) for v in range(VIEWS)]


def test_metadata_records_tokenizer_special_tokens_and_build_options(t2i):
    from support.sources import loaded_tokenizer

    dataset = t2i[0]
    tokenizer = loaded_tokenizer()
    assert dataset.tokenizer == tokenizer.identity
    assert dataset.special_tokens == tokenizer.special_tokens
    build_config = dataset.metadata["build"]
    assert build_config["source"] == "t2i" and build_config["options"]["views"] == VIEWS
