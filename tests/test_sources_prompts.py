"""prompts: UniRL's prompt-file contract — formats, ids, metadata, condition images, refusals."""

import json

import pytest
from support.sources import build, encode, image_bytes, write_jsonl

from mmidx.ingest import BuildError
from mmidx.sources import SourceError


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "frames").mkdir()
    (tmp_path / "frames" / "scene.png").write_bytes(image_bytes(40, 30, "RGB", "PNG", seed=5))
    return tmp_path


def _prompts(dataset):
    return [dataset[i].extra for i in range(len(dataset))]


def test_txt_files_give_one_prompt_per_non_empty_line(folder):
    (folder / "train.txt").write_text("A drone shot over a forest.\n\n  Clouds over a canyon.  \n")
    dataset, _ = build("prompts", [folder / "train.txt"], folder / "out")
    assert [p["prompt"] for p in _prompts(dataset)] == ["A drone shot over a forest.", "Clouds over a canyon."]
    assert [p["prompt_id"] for p in _prompts(dataset)] == ["train.txt:0", "train.txt:1"]


def test_json_lists_of_strings_and_objects_and_prompts_dicts_are_read(folder):
    (folder / "a.json").write_text(json.dumps(["plain string", {"prompt": "an object", "prompt_id": "mine"}]))
    (folder / "b.json").write_text(json.dumps({"prompts": [{"caption": "from caption"}]}))
    write_jsonl(folder / "c.jsonl", [{"prompt": "a jsonl line"}])
    dataset, _ = build("prompts", [folder / "a.json", folder / "b.json", folder / "c.jsonl"], folder / "out")
    assert [(p["prompt"], p["prompt_id"]) for p in _prompts(dataset)] == [
        ("plain string", "a.json:0"), ("an object", "mine"), ("from caption", "b.json:0"),
        ("a jsonl line", "c.jsonl:0")]


def test_extra_keys_fold_into_metadata_unless_metadata_is_given(folder):
    write_jsonl(folder / "p.jsonl", [{"prompt": "x", "style": "oil", "score": 3},
                                     {"prompt": "y", "style": "ink", "metadata": {"kept": True}}])
    dataset, _ = build("prompts", [folder / "p.jsonl"], folder / "out")
    assert [p["metadata"] for p in _prompts(dataset)] == [{"style": "oil", "score": 3}, {"kept": True}]


def test_condition_images_are_stored_with_resolved_uris_and_planned_before_the_prompt(folder):
    absolute = str(folder / "frames" / "scene.png")
    write_jsonl(folder / "p.jsonl", [
        {"prompt": "Animate this scene.", "media_refs": [{"modality": "image", "role": "condition",
                                                          "uri": "frames/scene.png"}]},
        {"prompt": "Same, absolute.", "media": [{"modality": "image", "role": "condition", "uri": absolute}]}])
    dataset, _ = build("prompts", [folder / "p.jsonl"], folder / "out")
    for i in range(2):
        sample = dataset[i]
        assert sample.extra["media_refs"][0]["uri"] == absolute
        assert bytes(sample.image(0).data) == (folder / "frames" / "scene.png").read_bytes()
        plan = [(e["type"], e["payload"], e["loss"]) for e in sample.sequence_plan(0)]
        assert plan == [("vae_image", 0, 0), ("vit_image", 0, 0), ("text", 0, 0)]
    assert dataset[0].text(0).tolist() == encode("Animate this scene.")


def test_legacy_embedding_fields_stop_the_build_with_a_clear_error(folder):
    write_jsonl(folder / "p.jsonl", [{"prompt": "x", "prompt_embed_path": "emb/0.pt"}])
    with pytest.raises(BuildError, match=r"prompt_embed_path.*computed at run time"):
        build("prompts", [folder / "p.jsonl"], folder / "out")


def test_other_extensions_are_refused(folder):
    (folder / "prompts.csv").write_text("prompt\nx\n")
    with pytest.raises(SourceError, match=r"\.txt, \.jsonl or \.json"):
        build("prompts", [folder / "prompts.csv"], folder / "out")


def test_entries_without_a_prompt_are_skipped_and_counted(folder):
    write_jsonl(folder / "p.jsonl", [{"prompt": ""}, {"other": 1}, {"prompt": "kept"}])
    dataset, report = build("prompts", [folder / "p.jsonl"], folder / "out")
    assert [p["prompt"] for p in _prompts(dataset)] == ["kept"]
    assert report.data["skips"]["empty_text"]["count"] == 2


def test_media_other_than_condition_images_skip_the_entry(folder):
    write_jsonl(folder / "p.jsonl", [{"prompt": "x", "media_refs": [{"modality": "video", "role": "condition",
                                                                     "uri": "v.mp4"}]}, {"prompt": "y"}])
    dataset, report = build("prompts", [folder / "p.jsonl"], folder / "out")
    assert [p["prompt"] for p in _prompts(dataset)] == ["y"]
    assert report.data["skips"]["malformed_record"]["examples"][0]["row"] == 0
