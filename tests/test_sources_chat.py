"""chat: FastChat conversations as text-only plans, loss on assistant turns, extra keys first without loss."""

import pytest
from support.sources import build, encode, write_jsonl

VICUNA = {"id": 0, "conversations": [
    {"from": "human", "value": "What is up?"}, {"from": "gpt", "value": "Hello! How can I help you today?"},
    {"from": "human", "value": "Who are you?"}, {"from": "gpt", "value": "You can call me Vicuna."},
    {"from": "human", "value": "Goodbye"}, {"from": "gpt", "value": "Goodbye!"}],
    "instruction": "Role: Vicuna, trained by LMSYS", "role": "Vicuna"}
OPENAI_WORDS = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "Hi"},
                                  {"from": "assistant", "value": "Hello."}]}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    path = write_jsonl(folder / "chat.jsonl", [VICUNA, OPENAI_WORDS])
    return build("chat", [path], folder / "out", extra_keys=("role", "instruction"))


def _plan(sample):
    return [(sample.text(e["payload"]).tolist(), e["loss"], e["enable_cfg"], e["type"])
            for e in sample.sequence_plan(0)]


def test_turns_are_texts_with_loss_on_gpt_turns_only_after_the_extra_keys_in_their_order(chat):
    dataset, _ = chat
    expected = [(encode(VICUNA["role"]), 0), (encode(VICUNA["instruction"]), 0)]
    expected += [(encode(turn["value"]), int(turn["from"] == "gpt")) for turn in VICUNA["conversations"]]
    assert _plan(dataset[0]) == [(tokens, loss, 0, "text") for tokens, loss in expected]


def test_user_system_and_assistant_speakers_are_understood(chat):
    dataset, _ = chat
    expected = [(encode("Be brief."), 0), (encode("Hi"), 0), (encode("Hello."), 1)]
    assert _plan(dataset[1]) == [(tokens, loss, 0, "text") for tokens, loss in expected]


def test_chat_data_is_a_multimodal_dataset_without_images(chat):
    dataset, _ = chat
    assert dataset.kind == "multimodal"
    assert [dataset[i].num_images for i in range(len(dataset))] == [0, 0]
    assert [dataset[i].num_views for i in range(len(dataset))] == [1, 1]


def test_extra_keys_are_left_out_unless_asked_for(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [VICUNA])
    dataset, _ = build("chat", [path], tmp_path / "out")
    assert len(dataset[0].sequence_plan(0)) == len(VICUNA["conversations"])


def test_an_unknown_speaker_skips_the_row(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": [{"from": "robot", "value": "beep"},
                                                                   {"from": "gpt", "value": "ok"}]}, VICUNA])
    dataset, report = build("chat", [path], tmp_path / "out")
    assert len(dataset) == 1 and dataset[0].origin[1] == 1
    assert report.data["skips"]["malformed_record"]["count"] == 1


def test_rows_are_line_numbers_however_the_file_is_cut(tmp_path):
    lines = [VICUNA, "", "{broken", OPENAI_WORDS, "", VICUNA, OPENAI_WORDS, VICUNA]
    path = write_jsonl(tmp_path / "chat.jsonl", lines)
    whole, _ = build("chat", [path], tmp_path / "whole")
    cut, report = build("chat", [path], tmp_path / "cut", bytes_per_shard=200)
    assert report.data["units"] >= 3
    assert [cut[i].origin[1] for i in range(len(cut))] == [whole[i].origin[1] for i in range(len(whole))] \
        == [0, 3, 5, 6, 7]
    assert report.data["skips"]["invalid_json"]["examples"][0]["line"] == 3  # reported 1-based, as editors show it
